#!/usr/bin/env bash
# The tensor-parallel run on two GPUs, every step bounded in time, all results under one folder:
#   tests       each test of tests/test_sidecar_tp_gpu.py in its own pytest process (a hang costs that test)
#   checkpoints config.json and tokenizer of Qwen3.5-9B and Qwen3.6-27B: every later step builds the seeded random
#               bf16 weights in GPU memory (--load-format random), so nothing of 18 or 54 GB is written first
#   capacity    Qwen3.6-27B at tp=2: measured capacity per rank against `hybridkv plan` (bench/tp_capacity.py)
#   throughput  Qwen3.5-9B decode at batch 1/16/64/256, tp=1 then tp=2, with the collectives' share of a tp=2 step
#   serving     bench/serving.py at concurrency 64 against `hybridkv serve` with Qwen3.6-27B at tp=2
#
#   scripts/two_gpu_run.sh [--cpu] [--out DIR] [--steps tests,checkpoints,capacity,throughput,serving]
#
# Results go to --out (default $OUT, else bench/results/two-gpu-DATE): one log and one JSON per step, summary.txt
# last. Checkpoints go to $TMPDIR (default /tmp). --steps runs a subset, so a run can be split across calls sharing
# the folders. --cpu runs the same steps on CPU with gloo, on tiny models and tiny workloads, with the python on
# PATH (the suite runs it this way: tests/test_two_gpu_run.py); without it, the machine's own python3 runs the
# repository through scripts/gpu_env.sh, as scripts/gpu.sh does.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/run_args.sh
parse_run_args two_gpu_run.sh "bench/results/two-gpu-$(date -u +%F)" tests,checkpoints,capacity,throughput,serving \
  "$@"
checkpoints=${TMPDIR:-/tmp}
export PYTHONUNBUFFERED=1

if ((cpu)); then
  python=python
  tests_file=tests/test_sidecar_tp_failures.py  # the gloo twin of the GPU shutdown test
  tests_select=(-m "not gpu" -k close_in_the_middle)
  test_limit_s=120
  tiny=(--tiny)
  suffix=-tiny
  capacity_args=(--device cpu --tiny --max-num-seqs 8 --max-model-len 256 --max-num-batched-tokens 64
                 --kv-cache-memory 67108864)
  throughput_args=(--device cpu --tiny --batch-sizes 1,2 --prompt-len 8 --new-tokens 3 --max-num-seqs 8
                   --max-num-batched-tokens 64 --max-model-len 256 --collective-steps 1)
  serve_device=(--device cpu --max-num-seqs 8 --max-model-len 256 --kv-cache-memory 67108864)
  serving_args=(--requests 4 --concurrency 2 --prompt-min 8 --prompt-max 8 --output-min 3 --output-max 3 --warmup 0)
  limit_s=(120 120 180 180)
else
  source scripts/gpu_env.sh || exit 1
  python=python3
  # Each GPU sees its NVLink peer through NCCL's P2P transport; NVLink multicast stays off.
  export NCCL_NVLS_ENABLE=0
  tests_file=tests/test_sidecar_tp_gpu.py
  tests_select=(-m gpu)
  test_limit_s=360
  tiny=()
  suffix=
  capacity_args=(--device cuda --max-num-seqs 256 --max-model-len 32768)
  throughput_args=(--device cuda --batch-sizes 1,16,64,256 --hf-batch-sizes=)
  serve_device=(--device cuda --max-num-seqs 256 --max-model-len 8192)
  serving_args=(--requests 256 --concurrency 64)
  limit_s=(600 600 600 600)  # checkpoints, capacity, throughput (each tp), serving
fi
ckpt_9b=$checkpoints/hybridkv-qwen3.5-9b$suffix-bf16
ckpt_27b=$checkpoints/hybridkv-qwen3.6-27b$suffix-bf16

summary=()
status=0
step_started=$SECONDS
record() {  # step name, exit code, result; the seconds since the last record
  summary+=("$1|$2|$((SECONDS - step_started))|$3")
  if [ "$2" -ne 0 ]; then status=1; fi
  echo "== $1: rc $2 after $((SECONDS - step_started)) s"
  step_started=$SECONDS
}
bounded() {  # seconds, log file, command...: run it under a hard time limit, its output to the terminal and the log
  local seconds=$1 log=$2
  shift 2
  timeout -k 20 "$seconds" "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}
has() { [[ ",$steps," == *",$1,"* ]]; }

if has tests; then
  mapfile -t nodes < <($python -P -m pytest --collect-only -q -p no:cacheprovider -o addopts="" "${tests_select[@]}" \
    "$tests_file" 2>/dev/null | grep '::')
  if ((${#nodes[@]} == 0)); then record "tests: none collected in $tests_file" 1 "-"; fi
  for node in "${nodes[@]}"; do
    name=${node##*::}
    bounded "$test_limit_s" "$out/test-$name.log" $python -P -m pytest -p no:cacheprovider -o addopts="" -q -rfEs \
      "${tests_select[@]:0:2}" "$node"
    record "test $name" $? "$out/test-$name.log"
  done
fi

if has checkpoints; then
  for pair in "qwen3.5-9b:$ckpt_9b" "qwen3.6-27b:$ckpt_27b"; do
    model=${pair%%:*} folder=${pair#*:}
    if [ -f "$folder/generation_config.json" ]; then  # make-model writes it last: the checkpoint is complete
      record "checkpoint $model" 0 "$folder (already there)"
      continue
    fi
    bounded "${limit_s[0]}" "$out/checkpoint-$model.log" $python -P -m hybridkv make-model --catalog "$model" \
      --dtype bfloat16 "${tiny[@]}" --config-only --force --out "$folder"
    record "checkpoint $model" $? "$folder"
  done
fi

if has capacity; then
  bounded "${limit_s[1]}" "$out/capacity-27b-tp2.log" $python -P bench/tp_capacity.py --model qwen3.6-27b \
    --checkpoint "$ckpt_27b" --tensor-parallel-size 2 --load-format random "${capacity_args[@]}" \
    --out "$out/capacity-27b-tp2.json"
  record "capacity qwen3.6-27b tp=2" $? "$out/capacity-27b-tp2.json"
fi

if has throughput; then
  for tp in 1 2; do
    bounded "${limit_s[2]}" "$out/throughput-9b-tp$tp.log" $python -P bench/throughput.py --model qwen3.5-9b \
      --checkpoint "$ckpt_9b" --tensor-parallel-size "$tp" --load-format random "${throughput_args[@]}" \
      --out "$out/throughput-9b-tp$tp.json"
    record "throughput qwen3.5-9b tp=$tp" $? "$out/throughput-9b-tp$tp.json"
  done
  if [ -f "$out/throughput-9b-tp1.json" ] && [ -f "$out/throughput-9b-tp2.json" ]; then
    $python -P - "$out/throughput-9b-tp1.json" "$out/throughput-9b-tp2.json" <<'EOF' | tee "$out/throughput-9b-tp2-vs-tp1.md"
import json, sys

one, two = (json.load(open(path)) for path in sys.argv[1:])
rows_one = {row["batch"]: row for row in one["engine"]["rows"]}
print(f"\n{two['model']}, {two['device']}: decode tok/s at tp=2 against tp=1; collectives on rank 0 at tp=2\n")
print("| batch | tp=1 tok/s | tp=2 tok/s | tp=2 / tp=1 | tp=2 ms/step | collective ms/step | share of step |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for row in two["engine"]["rows"]:
    base = rows_one.get(row["batch"])
    c = row.get("collectives", {})
    share = f"{100 * c['collective_share_of_step']:.1f}%" if c else "-"
    ratio = f"{row['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}" if base else "-"
    print(f"| {row['batch']} | {base['decode_tokens_per_s']:.0f} | {row['decode_tokens_per_s']:.0f} | {ratio} | "
          f"{row['decode_ms_per_step']:.2f} | {c.get('collective_ms_per_step', float('nan')):.3f} | {share} |")
EOF
    record "throughput tp=2 against tp=1" "${PIPESTATUS[0]}" "$out/throughput-9b-tp2-vs-tp1.md"
  fi
fi

if has serving; then
  bounded "${limit_s[3]}" "$out/serving-27b-tp2.log" $python -P bench/serving.py \
    --serve-args "--model $ckpt_27b --tensor-parallel-size 2 --load-format random ${serve_device[*]}" \
    "${serving_args[@]}" \
    --out "$out/serving-27b-tp2.json"
  record "serving qwen3.6-27b tp=2" $? "$out/serving-27b-tp2.json"
fi

{
  printf '%-44s %-4s %-6s %s\n' "step" "rc" "s" "result"
  for line in "${summary[@]}"; do
    IFS='|' read -r step rc seconds result <<<"$line"
    printf '%-44s %-4s %-6s %s\n' "$step" "$rc" "$seconds" "$result"
  done
} | tee "$out/summary.txt"
exit "$status"
