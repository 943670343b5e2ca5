# The hybridkv operator: kopf handlers, the planner and the gRPC client. No torch.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t hybridkv-operator .
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
# A virtual environment at one path: the same layout whether BASE keeps Python in /usr/local or in /usr.
# -P: the folder operator/ here would shadow the standard library module of that name.
# The local package itself; its dependencies are bounded in pyproject.toml.
# hadolint ignore=DL3013
RUN python3 -P -m venv /opt/hybridkv \
    && /opt/hybridkv/bin/pip install --no-cache-dir ".[operator]"

FROM ${BASE}
LABEL org.opencontainers.image.title="hybridkv-operator" \
      org.opencontainers.image.description="kopf operator for HybridModel resources" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/hybridkv /opt/hybridkv
RUN groupadd --gid 10001 hybridkv \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin hybridkv
ENV PATH=/opt/hybridkv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# Numeric user, so Kubernetes can verify runAsNonRoot without a user database.
USER 10001:10001
ENTRYPOINT ["hybridkv"]
CMD ["operator"]
