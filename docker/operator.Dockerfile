# The hybridkv operator: kopf handlers, the planner and the gRPC client. No torch.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t hybridkv-operator .
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY sizing ./sizing
COPY kernels ./kernels
COPY sidecar ./sidecar
COPY operator ./operator
COPY protos ./protos
# The local package itself; its dependencies are bounded in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --prefix=/install ".[operator]"

FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="hybridkv-operator" \
      org.opencontainers.image.description="kopf operator for HybridModel resources" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /install /usr/local
RUN groupadd --gid 10001 hybridkv \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin hybridkv
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# Numeric user, so Kubernetes can verify runAsNonRoot without a user database.
USER 10001:10001
ENTRYPOINT ["hybridkv"]
CMD ["operator"]
