#!/usr/bin/env bash
# KV tier checks + benchmark on a GPU machine, end to end, in one command:
#   bench/gpu_tiers.sh                 # uses .venv, SSD dir /tmp/kvdrive-gpu-bench
#   SSD_DIR=/mnt/nvme/kv INSTALL_GPU_EXTRA=1 STRICT=1 bench/gpu_tiers.sh
# Steps: (1) CUDA present? (2) optionally install the 'gpu' extra (kvikio) and isal, (3) the GPU-marked
# tier tests (CUDA device tier, pinned DRAM, SSD into device memory, KvikIO backend, store on CUDA),
# (4) the whole tests/kvcache suite on this host, (5) `kvdrive bench tiers` with the POSIX backend and,
# when kvikio is usable, the same benchmark with the KvikIO backend. Results: $OUT/tiers-gpu*.json/png.
# STRICT=1 fails when any GPU-marked test skipped (e.g. kvikio missing); ALLOW_CPU=1 runs without CUDA
# (a smoke test of the script itself: the GPU tests then skip).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
SSD_DIR="${SSD_DIR:-/tmp/kvdrive-gpu-bench}"
OUT="${OUT:-$ROOT/bench/results}"
STRICT="${STRICT:-0}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"  # never run python inside the repo root: its operator/ folder shadows the stdlib module

echo "== 1. CUDA"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
ALLOW_CPU="${ALLOW_CPU:-0}" "$PY" - <<'EOF'
import os, sys, torch
ok = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", ok,
      torch.cuda.get_device_name(0) if ok else "")
if not ok and os.environ["ALLOW_CPU"] != "1":
    sys.exit("no CUDA device: this script is for a GPU machine (ALLOW_CPU=1 runs it anyway, GPU tests skip)")
EOF

if [[ "${INSTALL_GPU_EXTRA:-0}" == "1" ]]; then
  echo "== 2. installing the gpu extra (kvikio) and isal"
  "$VENV/bin/pip" install -q -e "$ROOT[gpu]" isal
fi
"$PY" - <<'EOF'
import importlib.util
from kvdrive.runtime.kvcache.tiers.checksum import CRC32_IMPL
from kvdrive.runtime.kvcache.tiers.kvikio_backend import kvikio_usable
print("kvikio installed:", importlib.util.find_spec("kvikio") is not None, "usable:", kvikio_usable(),
      "| crc32:", CRC32_IMPL)
EOF

echo "== 3. GPU-marked tier tests"
"$VENV/bin/pytest" -p no:cacheprovider --rootdir "$ROOT" -m gpu -rs -q "$ROOT/tests/kvcache" | tee "$TMP/gpu.log"
if [[ "$STRICT" == "1" ]] && grep -q "skipped" "$TMP/gpu.log"; then
  echo "STRICT: some GPU tests skipped" >&2
  exit 4
fi

echo "== 4. all tier tests on this host"
"$VENV/bin/pytest" -p no:cacheprovider --rootdir "$ROOT" -q "$ROOT/tests/kvcache"

echo "== 5. tier benchmark (POSIX O_DIRECT backend) -> $OUT/tiers-gpu.json"
mkdir -p "$OUT" "$SSD_DIR"
"$VENV/bin/kvdrive" bench tiers --ssd-dir "$SSD_DIR" --out "$OUT/tiers-gpu.json" > /dev/null
"$PY" - "$OUT/tiers-gpu.json" "$SSD_DIR" "$OUT/tiers-gpu-kvikio.json" <<'EOF'
import json, sys
from kvdrive.runtime.bench.tier_bench import run_tier_bench
from kvdrive.runtime.kvcache.tiers.kvikio_backend import KvikioSsdTier, kvikio_usable

def show(path):
    r = json.load(open(path))
    print(path, "| ssd:", r["ssd"], "| load", r["loadavg_start"])
    for row in r["results"]:
        print(f'  {row["batch_bytes"] >> 10:5d} KiB  gpu r/w {row["gpu"]["read_GBps"]:.2f}/{row["gpu"]["write_GBps"]:.2f}'
              f'  dram {row["dram"]["read_GBps"]:.2f}/{row["dram"]["write_GBps"]:.2f}'
              f'  ssd read {row["ssd"]["read_GBps"]:.2f} raw {row["raw_odirect"]["read_GBps"]:.2f}'
              f'  ratio {row["ssd_read_vs_raw"]:.2f} (fixed dest {row["ssd_read_vs_raw_fixed_dest"]:.2f})')

show(sys.argv[1])
if kvikio_usable():
    print("== 5b. tier benchmark (KvikIO backend) ->", sys.argv[3])
    run_tier_bench(sys.argv[2], out_json=sys.argv[3], out_png=sys.argv[3].replace(".json", ".png"),
                   ssd_factory=KvikioSsdTier)
    show(sys.argv[3])
EOF
echo "done"
