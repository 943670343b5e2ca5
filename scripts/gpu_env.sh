# Sourced by scripts/gpu.sh and scripts/two_gpu_run.sh from the repository root: makes this repository importable as
# hybridkv with the machine's own python3 (no registry, no pip install of this repo; wheels it lacks travel in .whl/).
repo=$PWD
site=${TMPDIR:-/tmp}/site
tree=${TMPDIR:-/tmp}/hk
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
fi

# The import tree pip would build: hybridkv from src/, the mapped component folders linked under their package names.
rm -rf "$tree"
mkdir -p "$tree/hybridkv"
cp -r src/hybridkv/. "$tree/hybridkv/"
for pair in sizing:sizing kernels:kernels sidecar:sidecar operator:operator protos:api; do
  ln -s "$repo/${pair%%:*}" "$tree/hybridkv/${pair##*:}"
done
export PYTHONPATH="$tree:$site${PYTHONPATH:+:$PYTHONPATH}"

python3 - <<'EOF'
import torch, triton
print(f"python3 {__import__('sys').version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF
