#!/usr/bin/env bash
# The served path under load on one GPU, every step bounded in time, all results under one folder:
#   parts   bench/throughput.py (no transformers baseline): the engine's own decode step times and prefill rate, the
#           sum-of-parts bound the grpc and http phases are read against (--parts), and the decode table itself
#   stall   64 requests of the reference workload's prompt lengths (shorter outputs), one at a time over gRPC: the
#           first-shape stall check (no TTFT above twice its length bucket's median), which queueing hides at
#           higher concurrency, and the kernels the server compiled meanwhile
#   grpc    bench/serving.py, the reference workload at concurrency 64 and 256, over gRPC
#   http    the same workload at concurrency 64 over the OpenAI-compatible HTTP API of the same server
#   prefix  the chat workload (a 2,048-token system prompt, 64 conversations of 4 turns at once) over gRPC as token
#           ids and over the HTTP chat endpoint as messages (which the server re-renders through the chat template
#           every turn), and a shared-document workload over gRPC, against the same server without prefix caching,
#           then against one started with --enable-prefix-caching
#   chat    the prefix step's first phase alone (the chat workload over gRPC as token ids, without and then with
#           prefix caching): its TTFT and request-time split in a call too short for the whole prefix step
#   document  the prefix step's shared-document phase alone, the same way (with chat: both gRPC workloads)
#   chat-http the prefix step's chat phase over the HTTP chat endpoint alone, the same way
#   overhead  rounds of a shorter random workload at concurrency 64, alternating gRPC and HTTP on the plain server:
#           each front door's median TPOT and ITL over its rounds, and HTTP's overhead on them (overhead.json)
# One `hybridkv serve` of Qwen3.5-4B with seeded random bf16 weights built in GPU memory (--load-format random: only
# config.json and the tokenizer are written), prefix caching off, serves the grpc and http steps and the uncached
# prefix phases.
#
#   scripts/serving_run.sh [--cpu] [--out DIR]
#                          [--steps parts,stall,grpc,http,overhead,prefix,chat,document,chat-http]
#                          [--serve-flags "FLAGS"]
#
# Results go to --out (default $OUT, else bench/results/serving-DATE): one log and one JSON per phase, the servers'
# logs, serving-run.json (every phase's JSON in one), summary.txt last. --cpu runs the same steps on CPU on a tiny
# model and tiny workloads, with the python on PATH; without it, the machine's own python3 runs the repository
# through scripts/gpu_env.sh, as scripts/gpu.sh does. --serve-flags adds `hybridkv serve` flags to every server it
# starts (e.g. "--max-num-batched-tokens 4096"), so one setting's effect is read step by step against a run without.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/run_args.sh
takes_serve_flags=1
parse_run_args serving_run.sh "bench/results/serving-$(date -u +%F)" \
  parts,stall,grpc,http,overhead,prefix,chat,document,chat-http "$@"
export PYTHONUNBUFFERED=1

if ((cpu)); then
  python=python
  suffix=-tiny
  model_args=(--tiny)
  serve_args=(--device cpu --max-num-seqs 8 --max-model-len 512 --kv-cache-memory 64Mi)
  random_args=(--requests 8 --prompt-min 8 --prompt-max 64 --output-min 2 --output-max 6 --warmup 0)
  grpc_concurrency=2,4
  http_concurrency=2
  chat_args=(--requests 8 --turns 2 --system-tokens 32 --prompt-min 8 --prompt-max 16 --output-min 2 --output-max 4
             --concurrency 2 --warmup 0)
  document_args=(--requests 8 --documents 2 --document-tokens 80 --prompt-min 8 --prompt-max 16 --output-min 2
                 --output-max 4 --concurrency 2 --warmup 0)
  overhead_args=(--requests 4 --prompt-min 8 --prompt-max 32 --output-min 4 --output-max 8 --warmup 0)
  overhead_rounds=2
  stall_args=(--requests 4 --prompt-min 8 --prompt-max 64 --output-min 2 --output-max 6)
  parts_args=(--device cpu --tiny --batch-sizes 2,4 --prompt-len 16 --new-tokens 4 --max-num-seqs 8
              --max-model-len 512)
  ready_s=120
  limit_s=120
else
  source scripts/gpu_env.sh || exit 1
  python=python3
  suffix=
  model_args=(--dtype bfloat16)
  serve_args=(--device cuda --max-num-seqs 256 --max-model-len 8192)
  random_args=(--requests 512)
  grpc_concurrency=64,256
  http_concurrency=64
  chat_args=(--requests 256 --turns 4 --concurrency 64 --system-tokens 2048 --prompt-max 1000 --output-max 128)
  document_args=(--requests 256 --concurrency 64 --documents 4 --document-tokens 2048 --prompt-max 1000
                 --output-max 128)
  overhead_args=(--requests 256)
  overhead_rounds=3
  stall_args=(--requests 64 --output-max 64)
  parts_args=(--load-format random --batch-sizes 1,16,64,256)
  ready_s=200
  limit_s=150
fi
folder=${TMPDIR:-/tmp}/hybridkv-qwen3.5-4b$suffix-config

summary=()
status=0
step_started=$SECONDS
record() {  # step name, exit code, result; the seconds since the last record
  summary+=("$1|$2|$((SECONDS - step_started))|$3")
  [ "$2" -ne 0 ] && status=1
  step_started=$SECONDS
}

free_port() {
  "$python" -P -c 'from hybridkv.net import free_loopback_port; print(free_loopback_port())'
}

server_pid=
stop_server() {
  if [ -n "$server_pid" ]; then
    kill -TERM "$server_pid" 2>/dev/null
    wait "$server_pid" 2>/dev/null
    server_pid=
  fi
}
trap stop_server EXIT

start_server() {  # name, extra serve flags...; sets grpc_port, http_port, metrics_port; returns non-zero if not ready
  local name=$1
  shift
  grpc_port=$(free_port) http_port=$(free_port) metrics_port=$(free_port) health_port=$(free_port)
  "$python" -P -m hybridkv serve --model "$folder" --load-format random "${serve_args[@]}" "${serve_flags[@]}" "$@" \
    --host 127.0.0.1 --port "$grpc_port" --http-port "$http_port" --metrics-port "$metrics_port" \
    --health-port "$health_port" \
    >"$out/serve-$name.log" 2>&1 &
  server_pid=$!
  "$python" -P - "$grpc_port" "$server_pid" "$ready_s" <<'EOF'
import os, sys, time
import grpc
from hybridkv.api.client import READINESS_SERVICE, GenerationClient
port, pid, limit_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
started = time.monotonic()
with GenerationClient(f"127.0.0.1:{port}") as client:
    while time.monotonic() - started < limit_s:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("the server exited before it was ready")
        try:
            if client.check_health(READINESS_SERVICE, timeout_s=1.0) == "SERVING":
                print(f"ready in {time.monotonic() - started:.1f} s")
                sys.exit(0)
        except grpc.RpcError:
            pass
        time.sleep(0.5)
sys.exit(f"not ready within {limit_s:g} s")
EOF
}

bench() {  # phase name, serving.py flags...; the running server's CPU is measured per phase
  local name=$1
  shift
  timeout "$limit_s" "$python" -P bench/serving.py "$@" --server-pid "$server_pid" \
    --out "$out/serving-$name.json" 2>&1 | tee "$out/serving-$name.log"
  record "$name" "${PIPESTATUS[0]}" "$out/serving-$name.json"
}

prefix_phases() {  # cached or uncached, then the phases to run (chat-grpc, chat-chat, document-grpc): the chat
  # workload as token ids over gRPC, as messages over HTTP chat, the shared-document workload over gRPC
  local cache=$1 metrics=(--metrics-url "http://127.0.0.1:$metrics_port/metrics")
  shift
  [[ " $* " == *" chat-grpc "* ]] &&
    bench "chat-grpc-$cache" --target "grpc://127.0.0.1:$grpc_port" --workload chat "${chat_args[@]}" "${metrics[@]}"
  [[ " $* " == *" chat-chat "* ]] &&
    bench "chat-chat-$cache" --target "http://127.0.0.1:$http_port" --api chat --workload chat "${chat_args[@]}" \
      "${metrics[@]}"
  [[ " $* " == *" document-grpc "* ]] &&
    bench "document-grpc-$cache" --target "grpc://127.0.0.1:$grpc_port" --workload document "${document_args[@]}" \
      "${metrics[@]}"
  return 0
}

"$python" -P -m hybridkv make-model --catalog qwen3.5-4b "${model_args[@]}" --config-only --force --out "$folder" \
  >"$out/make-model.log" 2>&1
record make-model $? "$folder"
# An OpenAI-style target does not say its vocabulary: the random prompts' ids are drawn from config.json's.
vocab_size=$("$python" -P -c \
  'import json, sys; c = json.load(open(sys.argv[1])); print(c.get("text_config", c)["vocab_size"])' \
  "$folder/config.json")

parts=()
if [[ ,$steps, == *,parts,* ]]; then
  timeout "$limit_s" "$python" -P bench/throughput.py "${parts_args[@]}" --hf-batch-sizes= --out "$out/throughput.json" \
    >"$out/throughput.log" 2>&1
  rc=$?
  record parts "$rc" "$out/throughput.json"
  [ "$rc" -eq 0 ] && parts=(--parts "$out/throughput.json")
fi
if [[ $steps =~ stall|grpc|http|overhead|prefix|chat|document ]]; then
  start_server plain --no-enable-prefix-caching >"$out/ready-plain.log" 2>&1
  record "serve (plain)" $? "$(tail -n 1 "$out/ready-plain.log")"
fi
if [[ ,$steps, == *,stall,* ]]; then
  bench stall --target "grpc://127.0.0.1:$grpc_port" --metrics-url "http://127.0.0.1:$metrics_port/metrics" \
    "${stall_args[@]}" --concurrency 1 --warmup 1
fi
if [[ ,$steps, == *,grpc,* ]]; then
  bench grpc --target "grpc://127.0.0.1:$grpc_port" --metrics-url "http://127.0.0.1:$metrics_port/metrics" \
    "${random_args[@]}" --concurrency "$grpc_concurrency" "${parts[@]}"
fi
if [[ ,$steps, == *,http,* ]]; then
  bench http --target "http://127.0.0.1:$http_port" --vocab-size "$vocab_size" "${random_args[@]}" \
    --concurrency "$http_concurrency" --metrics-url "http://127.0.0.1:$metrics_port/metrics" "${parts[@]}"
fi
if [[ ,$steps, == *,overhead,* ]]; then
  for round in $(seq "$overhead_rounds"); do
    bench "overhead-grpc-$round" --target "grpc://127.0.0.1:$grpc_port" "${overhead_args[@]}" \
      --concurrency "$http_concurrency"
    bench "overhead-http-$round" --target "http://127.0.0.1:$http_port" --vocab-size "$vocab_size" \
      "${overhead_args[@]}" --concurrency "$http_concurrency"
  done
  "$python" -P -c '
import json, pathlib, statistics, sys
out, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
doors = {}
for door in ("grpc", "http"):
    phases = [json.loads((out / f"serving-overhead-{door}-{r}.json").read_text())["phases"][0]["summary"]
              for r in range(1, rounds + 1)]
    doors[door] = {key: statistics.median(phase[key]["p50"] for phase in phases) for key in ("tpot_ms", "itl_ms")}
result = {"rounds": rounds, "median_p50_ms": doors,
          "http_overhead": {key: doors["http"][key] / doors["grpc"][key] - 1 for key in ("tpot_ms", "itl_ms")}}
print(json.dumps(result, indent=1))
' "$out" "$overhead_rounds" >"$out/overhead.json"
  record overhead $? "$out/overhead.json"
fi
prefix=()
[[ ,$steps, == *,prefix,* || ,$steps, == *,chat,* ]] && prefix+=(chat-grpc)
[[ ,$steps, == *,prefix,* || ,$steps, == *,chat-http,* ]] && prefix+=(chat-chat)
[[ ,$steps, == *,prefix,* || ,$steps, == *,document,* ]] && prefix+=(document-grpc)
if ((${#prefix[@]})); then
  prefix_phases uncached "${prefix[@]}"
  stop_server
  start_server prefix --enable-prefix-caching >"$out/ready-prefix.log" 2>&1
  record "serve (prefix caching)" $? "$(tail -n 1 "$out/ready-prefix.log")"
  prefix_phases cached "${prefix[@]}"
fi
stop_server

# Every phase's result in one file as well, for a machine that hands back only a few files.
"$python" -P -c '
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
phases = {path.stem.removeprefix("serving-"): json.loads(path.read_text())
          for path in sorted(out.glob("serving-*.json")) if path.name != "serving-run.json"}
parts = out / "throughput.json"
print(json.dumps({"steps": phases, "parts": json.loads(parts.read_text()) if parts.is_file() else None}, indent=1))
' "$out" >"$out/serving-run.json"

{
  echo
  printf '%-24s %-4s %-7s %s\n' "step" "rc" "seconds" "result"
  for line in "${summary[@]}"; do
    IFS='|' read -r step rc seconds result <<<"$line"
    printf '%-24s %-4s %-7s %s\n' "$step" "$rc" "$seconds" "$result"
  done
} | tee "$out/summary.txt"
exit "$status"
