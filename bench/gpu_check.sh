#!/usr/bin/env bash
# The CUDA path on a GPU machine, stage by stage, everything written under $OUT:
#   bench/gpu_check.sh tests tiers        # GPU-marked tests (JUnit XML + log), then the tier bandwidth benchmark
#   bench/gpu_check.sh generate decode    # the demo model on CUDA: greedy text, then `kvdrive bench decode`
#   bench/gpu_check.sh all                # all four
# Stages:
#   tests     every test marked `gpu` (CUDA device tier, pinned DRAM, SSD into device memory, KvikIO, the engine
#             and each weight format on CUDA, the decode bench on CUDA) -> gpu-tests.log, gpu-tests.xml
#   tiers     `kvdrive bench tiers` (POSIX O_DIRECT backend; KvikIO too when usable) -> tiers-gpu*.json/png
#   generate  the demo model's greedy answer to one chat prompt on CUDA and on the CPU, each in its default
#             formats and in float32 -> generate.txt (stderr: generate.log)
#   attention a 512-token prompt chunk's attention, the fused lower-right kernel against the explicit mask,
#             at the demo model's heads -> attention-gpu.txt
#   profile   where a fresh prompt's prefill spends its time on $DEVICE: wall time per chunk with every page
#             on the device tier, then under the decode bench's kvdrive budgets (SSD write-back), then
#             cProfile and torch.profiler tables of the latter -> profile-prefill.txt
#   decode    `kvdrive bench decode --device cuda`: the placements, full attention on the device and the compute
#             floor in one run -> decode-gpu.json/md/png
# Environment: PY (a python with torch and the project's dependencies: default .venv/bin/python, else python3);
# OUT (default bench/results/gpu); SSD_DIR (default /tmp/kvdrive-gpu); MODEL (default demo); CONTEXTS, BATCHES,
# MODES, STEPS, WARMUP (the decode stage); PROFILE_CTX (the profile stage's prompt, default 7168 tokens); TESTS_K (a pytest -k expression for the tests stage); DEVICE (default cuda; ALLOW_CPU=1 runs every stage on a CPU host, as
# a smoke test of this script: the GPU tests skip there); STRICT=1 fails when a GPU-marked test skipped.
# Every stage runs even when one before it failed; the exit status counts the stages that failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PY:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi
OUT="${OUT:-$ROOT/bench/results/gpu}"
SSD_DIR="${SSD_DIR:-/tmp/kvdrive-gpu}"
MODEL="${MODEL:-demo}"
DEVICE="${DEVICE:-cuda}"
CONTEXTS="${CONTEXTS:-2048 4096 7168}"
BATCHES="${BATCHES:-1 4 16}"
MODES="${MODES:-full-gpu sparse-gpu kvdrive ondemand fullfetch}"
STEPS="${STEPS:-16}"
WARMUP="${WARMUP:-8}"
STRICT="${STRICT:-0}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT" "$SSD_DIR"
cd "$TMP" || exit 1  # never run python inside the repo root: its operator/ folder shadows the stdlib module
export PYTHONUNBUFFERED=1
failed=0

kvdrive() {
  "$PY" -c 'import sys; from kvdrive.runtime.cli import main; sys.exit(main(sys.argv[1:]))' "$@"
}

stage() {  # stage NAME: banner, and the time it started
  echo "== $1 ($(date -u +%H:%M:%S))"
}

check_device() {
  stage "device"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/env.txt"
  ALLOW_CPU="${ALLOW_CPU:-0}" "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib.util, os, platform, sys
import torch
ok = torch.cuda.is_available()
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", ok, "|", torch.cuda.get_device_name(0) if ok else "no device")
from kvdrive.runtime.kvcache.store.tiers.checksum import CRC32_IMPL
from kvdrive.runtime.kvcache.store.tiers.kvikio_backend import kvikio_unusable_reason
print("kvikio installed:", importlib.util.find_spec("kvikio") is not None, "| unusable:", kvikio_unusable_reason(),
      "| crc32:", CRC32_IMPL)
if not ok and os.environ["ALLOW_CPU"] != "1":
    sys.exit("no CUDA device: this script is for a GPU machine (ALLOW_CPU=1 runs it anyway, GPU tests skip)")
EOF
}

run_tests() {
  stage "tests: every test marked gpu"
  mapfile -t files < <(cd "$ROOT" && grep -rl --include='test_*.py' "pytest.mark.gpu" tests | sort)
  echo "files: ${files[*]}"
  # plugins named, not auto-loaded: the machine's own pytest plugins stay out of the run
  (cd "$ROOT" && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -p pytest_asyncio.plugin -p pytest_timeout \
     -p no:cacheprovider -m gpu ${TESTS_K:+-k "$TESTS_K"} -rA -q --junitxml "$OUT/gpu-tests.xml" "${files[@]}") 2>&1 \
    | tee "$OUT/gpu-tests.log"
  local rc=${PIPESTATUS[0]}
  if [[ "$STRICT" == "1" ]] && grep -q "SKIPPED" "$OUT/gpu-tests.log"; then
    echo "STRICT: some GPU tests skipped" >&2
    rc=4
  fi
  return "$rc"
}

run_tiers() {
  stage "tiers: POSIX O_DIRECT backend -> $OUT/tiers-gpu.json"
  kvdrive bench tiers --ssd-dir "$SSD_DIR/tiers" --out "$OUT/tiers-gpu.json" > /dev/null || return 1
  "$PY" - "$OUT/tiers-gpu.json" "$SSD_DIR/tiers" "$OUT/tiers-gpu-kvikio.json" <<'EOF'
import json, sys
from kvdrive.runtime.bench.tier_bench import run_tier_bench
from kvdrive.runtime.kvcache.store.tiers.kvikio_backend import KvikioSsdTier, kvikio_unusable_reason

def show(path):
    r = json.load(open(path))
    print(path, "| ssd:", r["ssd"], "| load", r["loadavg_start"])
    for row in r["results"]:
        print(f'  {row["batch_bytes"] >> 10:5d} KiB  gpu r/w {row["gpu"]["read_GBps"]:.2f}/{row["gpu"]["write_GBps"]:.2f}'
              f'  dram {row["dram"]["read_GBps"]:.2f}/{row["dram"]["write_GBps"]:.2f}'
              f'  ssd read {row["ssd"]["read_GBps"]:.2f} raw {row["raw_odirect"]["read_GBps"]:.2f}'
              f'  ratio {row["ssd_read_vs_raw"]:.2f} (fixed dest {row["ssd_read_vs_raw_fixed_dest"]:.2f})')

show(sys.argv[1])
if kvikio_unusable_reason() is None:
    print("== tiers: KvikIO backend ->", sys.argv[3])
    run_tier_bench(sys.argv[2], out_json=sys.argv[3], out_png=sys.argv[3].replace(".json", ".png"),
                   ssd_factory=KvikioSsdTier)
    show(sys.argv[3])
EOF
}

run_generate() {
  stage "generate: $MODEL, greedy, on $DEVICE and on the CPU"
  local prompt="In two sentences, why do long prompts need a large KV cache?"
  : > "$OUT/generate.txt"
  : > "$OUT/generate.log"
  # each device's default (auto weights and dtype), then float32 weights and activations on both, which agree
  for flags in "--device $DEVICE" "--device cpu" "--device $DEVICE --weights fp32 --dtype float32" \
               "--device cpu --weights fp32 --dtype float32"; do
    echo "-- $flags" | tee -a "$OUT/generate.txt"
    # shellcheck disable=SC2086  # the flags are meant to split
    kvdrive generate --model "$MODEL" $flags --chat --prompt "$prompt" --max-tokens 48 --temperature 0 \
      2>>"$OUT/generate.log" | tee -a "$OUT/generate.txt"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || return 1
  done
}

run_attention() {
  stage "attention: a 512-token chunk continuing T tokens on $DEVICE, fused lower-right kernel vs explicit mask"
  "$PY" - "$DEVICE" <<'EOF' 2>&1 | tee "$OUT/attention-gpu.txt"
import sys, time
import torch
from kvdrive.runtime.attention import causal_attention

device = torch.device(sys.argv[1])
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
hq, hkv, d, n = 9, 3, 64, 512  # the demo model's heads
print(f"{'dtype':9s} {'T':>6s} {'explicit ms':>12s} {'fused ms':>9s} {'speedup':>8s} {'max |diff|':>10s}")
for dtype in (torch.bfloat16, torch.float32):
    for t in (1024, 4096, 7168, 16384):
        q = torch.randn(n, hq, d, device=device, dtype=dtype)
        k, v = (torch.randn(hkv, t, d, device=device, dtype=dtype) for _ in range(2))
        pos = torch.arange(t - n, t, device=device)
        ms, outs = [], []
        for fused in (False, True):
            outs.append(causal_attention(q, k, v, pos, fused=fused))  # warm-up
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                causal_attention(q, k, v, pos, fused=fused)
            sync()
            ms.append((time.perf_counter() - t0) * 100)
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            causal_attention(q, k, v, pos)
        ran = sorted({e.key for e in prof.key_averages() if e.key.startswith(("aten::_scaled_dot", "aten::_efficient",
                                                                             "aten::_flash"))})
        print(f"{str(dtype)[6:]:9s} {t:6d} {ms[0]:12.2f} {ms[1]:9.2f} {ms[0] / ms[1]:7.1f}x {diff:10.2e}  {ran}",
              flush=True)
EOF
  return "${PIPESTATUS[0]}"
}

run_profile() {
  stage "profile: a fresh ${PROFILE_CTX:-7168}-token prefill of $MODEL on $DEVICE"
  "$PY" - "$MODEL" "$DEVICE" "${PROFILE_CTX:-7168}" "$SSD_DIR/profile" <<'EOF' 2>&1 | tee "$OUT/profile-prefill.txt"
import cProfile, io, pstats, shutil, sys, time
import torch
from kvdrive.runtime.bench.texts import filler_tokens
from kvdrive.runtime.engine import ModelRunner
from kvdrive.runtime.kvcache.config import EngineConfig, TierConfig
from kvdrive.runtime.model import load_model

model, device, ctx, root = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
loaded = load_model(model, device=device)
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
probe = ModelRunner(loaded, EngineConfig(max_sequences=1))
total = ctx * (probe.cache.layout.page_bytes // probe.cache.layout.page_size)
probe.close()

def config(where: str) -> EngineConfig:
    if where == "device":
        return EngineConfig(tiers=TierConfig(gpu_bytes=3 * total + (256 << 20)), max_sequences=1)
    return EngineConfig(tiers=TierConfig(gpu_bytes=int(total * 0.1) + (64 << 20), dram_bytes=total // 4,
                                         ssd_dir=root, ssd_bytes=2 * total + (64 << 20)), max_sequences=1)

def prefill(where: str, seed: int, profile=None) -> None:
    shutil.rmtree(root, ignore_errors=True)
    gen = ModelRunner(loaded, config(where))
    toks = filler_tokens(loaded.tokenizer, ctx, seed=seed)
    chunk = gen.config.prefill_chunk
    try:
        seq, reused = gen.open_sequence(toks)
        assert reused == 0, reused
        times = []
        for i in range(0, len(toks), chunk):
            sync()
            t0 = time.perf_counter()
            if profile is not None:
                profile.enable()
            gen.prefill(seq, toks[i:i + chunk])
            sync()
            if profile is not None:
                profile.disable()
            times.append(time.perf_counter() - t0)
        print(f"{where:7s} {len(toks)} tokens in {sum(times):.2f} s; per {chunk}-token chunk (ms):",
              " ".join(f"{t * 1e3:.0f}" for t in times), flush=True)
    finally:
        gen.close()
        shutil.rmtree(root, ignore_errors=True)

prefill("device", 1)  # warm-up: kernels, allocator
for where in ("device", "tiered"):
    prefill(where, 4000)
prof = cProfile.Profile()
prefill("tiered", 4001, profile=prof)
s = io.StringIO()
st = pstats.Stats(prof, stream=s).strip_dirs()
st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(30)
print(s.getvalue(), flush=True)
cuda = device.startswith("cuda")
acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
with torch.profiler.profile(activities=acts) as tp:
    prefill("tiered", 4002)
table = tp.key_averages()
print(table.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30, max_name_column_width=60))
print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
EOF
  return "${PIPESTATUS[0]}"
}

run_decode() {
  stage "decode: $MODEL on $DEVICE, contexts $CONTEXTS, batches $BATCHES, modes $MODES"
  # shellcheck disable=SC2086  # the lists are meant to split into arguments
  kvdrive bench decode --model "$MODEL" --device "$DEVICE" --ssd-dir "$SSD_DIR/decode" --contexts $CONTEXTS \
    --batches $BATCHES --modes $MODES --steps "$STEPS" --warmup "$WARMUP" --no-llama-cpp \
    --out "$OUT/decode-gpu.json" 2>&1 | tee "$OUT/decode-gpu.log" | grep -v '%|'
  return "${PIPESTATUS[0]}"
}

stages=("$@")
[[ ${#stages[@]} -eq 0 || "${stages[0]}" == "all" ]] && stages=(tests tiers generate decode)
if [[ "${ALLOW_CPU:-0}" == "1" ]]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || DEVICE=cpu
fi
check_device || exit 3
for s in "${stages[@]}"; do
  case "$s" in
    tests) run_tests ;;
    tiers) run_tiers ;;
    generate) run_generate ;;
    attention) run_attention ;;
    profile) run_profile ;;
    decode) run_decode ;;
    *) echo "unknown stage $s (tests, tiers, generate, attention, profile, decode, all)" >&2; false ;;
  esac
  rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "!! stage $s failed (exit $rc)"
    failed=$((failed + 1))
  fi
done
stage "done: $failed stage(s) failed"
exit "$failed"
