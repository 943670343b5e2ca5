#!/usr/bin/env bash
# Runs GPU tests and benchmarks on a CUDA machine with what that machine has (its own python3, torch, triton,
# pytest): no registry, no pip install of this repo. Wheels it lacks (fla-core, grpcio) travel in .whl/.
#
#   scripts/gpu.sh [TEST_PATH ...] [bench/NAME.py [--flag=value ...] ...]
#   e.g. scripts/gpu.sh tests bench/kernel_speed.py --only=paged_decode,gdn_prefill bench/throughput.py
#
# Test paths (and pytest options) run as `pytest -m gpu`; bench/*.py scripts run after them, each with the --flags
# that follow it, writing JSON to $OUT (when set, the folder the run's results are collected from) or bench/results/. Logs go to the same
# folder. A summary table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
results=${OUT:-$repo/bench/results}
mkdir -p "$results"
source scripts/gpu_env.sh || exit 1

tests=()
benches=()
# Each bench's flags, kept whole (a value may hold spaces: --serve-args="--model DIR --device cuda"): flag i belongs
# to bench flag_owner[i].
flags=()
flag_owner=()
for arg in "$@"; do
  case "$arg" in
    bench/*.py | */bench/*.py) benches+=("$arg") ;;
    --*) if ((${#benches[@]})); then flags+=("$arg"); flag_owner+=($((${#benches[@]} - 1))); else tests+=("$arg"); fi ;;
    *) tests+=("$arg") ;;
  esac
done

summary=()
status=0
stamp=$(date -u +%F)
if ((${#tests[@]})); then
  python3 -P -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs --durations=8 "${tests[@]}" 2>&1 | tee "$results/gpu-tests.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 5 ] && rc=0  # no GPU test selected in these paths
  summary+=("pytest -m gpu ${tests[*]}|$rc|$(tail -n 1 "$results/gpu-tests.log")")
  [ "$rc" -ne 0 ] && status=1
fi
for index in "${!benches[@]}"; do
  bench=${benches[index]}
  name=$(basename "$bench" .py)
  args=()
  for i in "${!flags[@]}"; do
    [ "${flag_owner[i]}" -eq "$index" ] && args+=("${flags[i]}")
  done
  python3 "$bench" --out "$results/$name-$stamp.json" "${args[@]}" 2>&1 | tee "$results/$name.log"
  rc=${PIPESTATUS[0]}
  summary+=("$bench|$rc|$results/$name-$stamp.json")
  [ "$rc" -ne 0 ] && status=1
done

echo
printf '%-44s %-4s %s\n' "step" "rc" "result"
for line in "${summary[@]}"; do
  IFS='|' read -r step rc result <<<"$line"
  printf '%-44s %-4s %s\n' "$step" "$rc" "$result"
done
exit "$status"
