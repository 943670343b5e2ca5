# The hybridkv sidecar: the engine (torch, Triton kernels) behind the gRPC server.
# Build from the repository root: docker build -f docker/sidecar.Dockerfile -t hybridkv-sidecar .
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY sizing ./sizing
COPY kernels ./kernels
COPY sidecar ./sidecar
COPY operator ./operator
COPY protos ./protos
# The CUDA build of torch from PyPI carries its own CUDA libraries; the node supplies only the driver.
# The local package itself; its dependencies are bounded in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --prefix=/install "torch==2.11.0" "huggingface_hub==2.4.0" ".[engine]"

FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="hybridkv-sidecar" \
      org.opencontainers.image.description="hybridkv engine and gRPC server for hybrid LLMs" \
      org.opencontainers.image.licenses="Apache-2.0"
# Triton compiles its small launcher stubs with a C compiler the first time a kernel runs.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /install /usr/local
RUN groupadd --gid 10001 hybridkv \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin hybridkv
# The root filesystem is read-only in the pod: every cache goes to the emptyDir mounted at /cache.
ENV PYTHONDONTWRITEBYTECODE=1 \
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
