# The hybridkv sidecar: the engine (torch, Triton kernels) behind the gRPC server.
# Build from the repository root: docker build -f docker/sidecar.Dockerfile -t hybridkv-sidecar .
# BASE is any Debian-based image with python3 (3.11+) and its venv module; scripts/build-images.sh makes one.
ARG BASE=python:3.11.11-slim-bookworm
FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY sizing ./sizing
COPY kernels ./kernels
COPY sidecar ./sidecar
COPY operator ./operator
COPY protos ./protos
# The CUDA build of torch from PyPI carries its own CUDA libraries; the node supplies only the driver.
# torch is the version the test suite runs (the Makefile's TORCH_VERSION); a test keeps the two equal.
# -P: the folder operator/ here would shadow the standard library module of that name.
# safetensors writes tensors through numpy, which the engine extra does not bring (hybridkv make-model needs it).
# The local package itself; its dependencies are bounded in pyproject.toml.
# hadolint ignore=DL3013
RUN python3 -P -m venv /opt/hybridkv \
    && /opt/hybridkv/bin/pip install --no-cache-dir "torch==2.13.0" "huggingface_hub==2.4.0" numpy ".[engine]"

FROM ${BASE}
LABEL org.opencontainers.image.title="hybridkv-sidecar" \
      org.opencontainers.image.description="hybridkv engine and gRPC server for hybrid LLMs" \
      org.opencontainers.image.licenses="Apache-2.0"
# Triton compiles its small launcher stubs with a C compiler the first time a kernel runs.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/hybridkv /opt/hybridkv
RUN groupadd --gid 10001 hybridkv \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin hybridkv
# The root filesystem is read-only in the pod: every cache goes to the emptyDir mounted at /cache.
ENV PATH=/opt/hybridkv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    XDG_CACHE_HOME=/cache \
    HF_HUB_DISABLE_TELEMETRY=1
USER 10001:10001
EXPOSE 50051 9400
ENTRYPOINT ["hybridkv"]
CMD ["serve", "--help"]
