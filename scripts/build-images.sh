#!/usr/bin/env bash
# Builds the operator and sidecar images without a Docker engine, then runs each once.
#
# Usage (as root, from anywhere): scripts/build-images.sh [WORKDIR]
#   WORKDIR (default /var/tmp/hybridkv-images) holds the Debian root filesystem and the logs.
#   DEBIAN_SUITE (default bookworm) and DEBIAN_MIRROR (default: debootstrap's own) choose the base's packages.
#   TAG (default dev) tags the images localhost/hybridkv-operator:TAG and localhost/hybridkv-sidecar:TAG.
#   HOST_CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt, when present): this machine's trusted CAs, mounted
#   into the build's RUN steps for pip (a TLS-inspecting proxy's CA); never part of an image.
#
# 1. debootstrap a minimal Debian with python3 and its venv module, and import it as the image BASE (no registry
#    for base images is needed);
# 2. buildah builds docker/operator.Dockerfile and docker/sidecar.Dockerfile on that BASE;
# 3. the operator image runs `hybridkv operator --help`; the sidecar image writes a tiny random-weight checkpoint
#    and runs `hybridkv serve` on it on the CPU until its readiness service answers SERVING and GetCapacity reports.
# buildah runs with the vfs storage driver and chroot isolation, which work as root inside an unprivileged container.
# Not part of CI: it downloads torch and its CUDA libraries (several GB) and takes long on a small machine.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORKDIR=${1:-/var/tmp/hybridkv-images}
SUITE=${DEBIAN_SUITE:-bookworm}
TAG=${TAG:-dev}
BASE_IMAGE=localhost/hybridkv-base:$SUITE
OPERATOR_IMAGE=localhost/hybridkv-operator:$TAG
SIDECAR_IMAGE=localhost/hybridkv-sidecar:$TAG
# Seconds the sidecar may take to load the tiny checkpoint and report ready on the CPU.
SERVE_READY_TIMEOUT_S=${SERVE_READY_TIMEOUT_S:-600}
BUILDAH=(buildah --storage-driver vfs)

step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

if [ "$(id -u)" -ne 0 ]; then
  echo "build-images.sh: run as root (debootstrap and buildah's chroot isolation need it)" >&2
  exit 2
fi
for tool in buildah debootstrap; do
  if ! command -v "$tool" >/dev/null; then
    step "installing buildah and debootstrap from Debian's packages"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends buildah debootstrap
    break
  fi
done
mkdir -p "$WORKDIR"

rootfs=$WORKDIR/rootfs-$SUITE
if ! "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  step "debootstrap $SUITE into $rootfs"
  rm -rf "$rootfs"
  # shellcheck disable=SC2086 # an empty mirror means debootstrap's default
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" ${DEBIAN_MIRROR:-}
  # A base image carries no package lists or caches; the sidecar's build runs apt-get update itself.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  step "importing the root filesystem as $BASE_IMAGE"
  container=$("${BUILDAH[@]}" from scratch)
  mountpoint=$("${BUILDAH[@]}" mount "$container")
  tar -C "$rootfs" -c . | tar -C "$mountpoint" -x
  "${BUILDAH[@]}" unmount "$container"
  "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$container"
  "${BUILDAH[@]}" commit --rm "$container" "$BASE_IMAGE"
  rm -rf "$rootfs"
fi

HOST_CA_BUNDLE=${HOST_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}
build_volumes=()
if [ -n "$HOST_CA_BUNDLE" ] && [ -f "$HOST_CA_BUNDLE" ]; then
  printf '[global]\ncert = /run/hybridkv-build/ca-certificates.crt\n' > "$WORKDIR/pip.conf"
  build_volumes=(-v "$HOST_CA_BUNDLE:/run/hybridkv-build/ca-certificates.crt:ro" -v "$WORKDIR/pip.conf:/etc/pip.conf:ro")
fi

build() {  # build DOCKERFILE IMAGE
  step "building $2 from docker/$1 on $BASE_IMAGE"
  # --layers: a rerun after a change rebuilds only from the first changed step.
  "${BUILDAH[@]}" bud --isolation chroot --layers --pull=never --build-arg "BASE=$BASE_IMAGE" "${build_volumes[@]}" \
    --ignorefile "$ROOT/docker/$1.dockerignore" -f "$ROOT/docker/$1" -t "$2" "$ROOT"
}
build operator.Dockerfile "$OPERATOR_IMAGE"
build sidecar.Dockerfile "$SIDECAR_IMAGE"

run_in() {  # run_in IMAGE COMMAND...: a throwaway container of IMAGE, as the image's user
  local container status=0
  container=$("${BUILDAH[@]}" from --pull=never "$1")
  shift
  "${BUILDAH[@]}" run --isolation chroot "$container" -- "$@" || status=$?
  "${BUILDAH[@]}" rm "$container" >/dev/null
  return "$status"
}

step "operator image: hybridkv operator --help"
run_in "$OPERATOR_IMAGE" hybridkv operator --help

step "sidecar image: hybridkv serve on a tiny checkpoint (CPU) until ready"
# The readiness poll is the sidecar's own client; serve is stopped with SIGTERM (its drain path) once it answered.
run_in "$SIDECAR_IMAGE" bash -euc '
  hybridkv make-model --catalog qwen3.5-4b --tiny --seed 0 --out /tmp/tiny-model
  hybridkv serve --model /tmp/tiny-model --device cpu --host 127.0.0.1 --port 50051 --metrics-port 9400 \
    --max-num-seqs 4 --max-model-len 256 --max-num-batched-tokens 256 --kv-cache-memory 8Mi &
  serve=$!
  trap "kill -TERM $serve 2>/dev/null; wait $serve" EXIT
  python3 - "$0" <<"PY"
import sys, time
import grpc
from hybridkv.api.client import READINESS_SERVICE, GenerationClient
deadline_s = time.monotonic() + float(sys.argv[1])
client = GenerationClient("127.0.0.1:50051")
while True:
    try:
        if client.check_health(READINESS_SERVICE, timeout_s=5.0) == "SERVING":
            break
    except grpc.RpcError:
        pass
    if time.monotonic() > deadline_s:
        sys.exit("the sidecar did not report ready in time")
    time.sleep(2.0)
capacity = client.get_capacity()
print("sidecar ready:", capacity["token_capacity"], "tokens,", capacity["state_slots"], "state slots")
PY
' "$SERVE_READY_TIMEOUT_S"

step "done: $OPERATOR_IMAGE and $SIDECAR_IMAGE (buildah --storage-driver vfs images)"
"${BUILDAH[@]}" images
