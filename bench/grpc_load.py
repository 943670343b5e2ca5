#!/usr/bin/env python3
"""Bounded gRPC load test on loopback: requests/s, TTFT and inter-token latency, and the server's overhead.

The same workload (N requests, C at once, greedy, fixed prompt and output lengths) runs in alternating rounds, after
one warm-up round each, on one checkpoint:
  in-process  the engine driven directly from this process (add_request + step), no server;
  grpc        `hybridkv serve` in a subprocess, C concurrent Generate streams from this process's asyncio client.
Two overhead figures, both against the in-process engine on the same rounds:
  latency  (grpc median inter-token time - in-process median) / in-process median; target under 5% at 32 streams.
           Sensitive to other load on the machine: on a busy 2-core host the three parties (engine, server loop,
           client) and everything else compete for the cores.
  CPU      (server CPU per output token - in-process CPU per output token) / in-process CPU per token, read from
           /proc (Linux) over the server process and its descendants (the engine process); the server's event-loop
           thread (its main thread) is reported on its own.

    python bench/grpc_load.py                      # tiny random Qwen3.5-4B-shaped model, 32 streams
    python bench/grpc_load.py --catalog-model qwen3.5-0.8b --full-size --device cuda
    python bench/grpc_load.py --model DIR --device cuda --concurrency 64 --requests 256
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridkv.net import free_loopback_port

READY_TIMEOUT_S = 300.0


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (fraction in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summarize(name: str, ttft_s: list[float], itl_s: list[float], requests: int, tokens: int, wall_s: float) -> dict:
    return {
        "mode": name,
        "requests": requests,
        "output_tokens": tokens,
        "wall_s": wall_s,
        "requests_per_s": requests / wall_s,
        "output_tokens_per_s": tokens / wall_s,
        "ttft_ms": {f"p{int(q * 100)}": 1000 * percentile(ttft_s, q) for q in (0.5, 0.9, 0.99)},
        "itl_ms": {f"p{int(q * 100)}": 1000 * percentile(itl_s, q) for q in (0.5, 0.9, 0.99)},
        "itl_mean_ms": 1000 * statistics.fmean(itl_s),
    }


def prompt_ids(tokenizer_vocab: int, index: int, prompt_tokens: int) -> list[int]:
    # Distinct deterministic prompts, all of one length, avoiding the low ids (special tokens live at the top).
    return [(17 + 31 * index + 7 * position) % (tokenizer_vocab - 64) + 1 for position in range(prompt_tokens)]


def run_in_process(engine, args, requests: int, output_tokens: int) -> dict:
    """One round of the workload driven straight through engine.add_request / engine.step."""
    from hybridkv.sidecar.core.sampling import SamplingParams

    vocab = engine.geometry.vocab_size
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    ttft_s, itl_s = [], []
    arrival_s: dict[str, float] = {}
    last_s: dict[str, float] = {}
    next_index = 0
    finished = 0
    tokens = 0

    def admit() -> None:
        nonlocal next_index
        request_id = f"r{time.monotonic_ns()}-{next_index}"
        arrival_s[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt_ids(vocab, next_index, args.prompt_tokens), params)
        next_index += 1

    started_s = time.perf_counter()
    started_cpu_s = time.process_time()
    for _ in range(min(args.concurrency, requests)):
        admit()
    while finished < requests:
        for output in engine.step():
            now_s = time.perf_counter()
            count = len(output.new_token_ids)
            if count:
                tokens += count
                if output.request_id not in last_s:
                    ttft_s.append(now_s - arrival_s[output.request_id])
                    count -= 1
                else:
                    itl_s.extend([(now_s - last_s[output.request_id]) / count] * count)
                last_s[output.request_id] = now_s
            if output.finished:
                finished += 1
                if next_index < requests:
                    admit()
    return {"ttft_s": ttft_s, "itl_s": itl_s, "tokens": tokens, "wall_s": time.perf_counter() - started_s,
            "cpu_s": time.process_time() - started_cpu_s}


async def _grpc_round(args, target: str, vocab: int, requests: int, output_tokens: int) -> dict:
    """One round of the workload as concurrent Generate streams from an asyncio client."""
    from hybridkv.api.client import AsyncGenerationClient

    ttft_s, itl_s = [], []
    tokens = 0
    next_index = 0

    async with AsyncGenerationClient(target) as client:
        async def worker() -> None:
            nonlocal next_index, tokens
            while next_index < requests:
                index = next_index
                next_index += 1
                sent_s = time.perf_counter()
                last_s = None
                async for response in client.generate(prompt_ids(vocab, index, args.prompt_tokens),
                                                      max_tokens=output_tokens, temperature=0.0,
                                                      ignore_eos=True, timeout_s=READY_TIMEOUT_S):
                    now_s = time.perf_counter()
                    count = len(response.token_ids)
                    if not count:
                        continue
                    tokens += count
                    if last_s is None:
                        ttft_s.append(now_s - sent_s)
                        count -= 1
                    else:
                        itl_s.extend([(now_s - last_s) / count] * count)
                    last_s = now_s

        started_s = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, requests))))
        wall_s = time.perf_counter() - started_s
    return {"ttft_s": ttft_s, "itl_s": itl_s, "tokens": tokens, "wall_s": wall_s}


def _cpu_seconds(stat_path: str) -> float:
    """utime + stime of a /proc stat file, in seconds; 0 for a process that has already exited."""
    try:
        with open(stat_path) as handle:
            fields = handle.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants, from /proc/PID/task/TID/children (Linux)."""
    pids, index = [pid], 0
    while index < len(pids):
        task_dir = f"/proc/{pids[index]}/task"
        index += 1
        for task in os.listdir(task_dir) if os.path.isdir(task_dir) else ():
            try:
                with open(f"{task_dir}/{task}/children") as handle:
                    pids.extend(int(child) for child in handle.read().split())
            except FileNotFoundError:
                continue
    return pids


class SidecarProcess:
    """`hybridkv serve` in a subprocess on a free loopback port, ready on entry, terminated on exit."""

    def __init__(self, args, model_dir: Path):
        self.port = free_loopback_port()
        self.target = f"127.0.0.1:{self.port}"
        self._command = [
            sys.executable, "-P", "-m", "hybridkv", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(self.port), "--metrics-port", "0", "--device", args.device,
            "--max-num-seqs", str(args.concurrency), "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--kv-cache-memory", str(args.kv_cache_memory), "--grace-period-s", "5",
        ]

    def __enter__(self) -> SidecarProcess:
        import grpc

        from hybridkv.api.client import READINESS_SERVICE, GenerationClient

        self._log = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(self._command, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        with GenerationClient(self.target) as client:
            while True:
                if self._process.poll() is not None:
                    self._log.seek(0)
                    raise SystemExit(f"hybridkv serve exited with {self._process.returncode}:\n"
                                     f"{self._log.read()[-3000:]}")
                try:
                    if client.check_health(READINESS_SERVICE, timeout_s=1.0) == "SERVING":
                        return self
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline_s:
                    self.__exit__()
                    raise SystemExit("hybridkv serve did not turn ready in time")
                time.sleep(0.2)

    def cpu_seconds(self) -> tuple[float, float]:
        """(server process and its engine process, main thread = the asyncio event loop) CPU seconds so far."""
        pid = self._process.pid
        total_s = sum(_cpu_seconds(f"/proc/{member}/stat") for member in _process_tree(pid))
        return total_s, _cpu_seconds(f"/proc/{pid}/task/{pid}/stat")

    def __exit__(self, *exc_info) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


def pooled(mode: str, rounds: list[dict], requests: int) -> dict:
    tokens = sum(round_["tokens"] for round_ in rounds)
    figures = summarize(
        mode,
        [value for round_ in rounds for value in round_["ttft_s"]],
        [value for round_ in rounds for value in round_["itl_s"]],
        requests * len(rounds),
        tokens,
        sum(round_["wall_s"] for round_ in rounds),
    )
    figures["cpu_us_per_token"] = 1e6 * sum(round_["cpu_s"] for round_ in rounds) / tokens
    if all("loop_cpu_s" in round_ for round_ in rounds):
        figures["event_loop_cpu_us_per_token"] = 1e6 * sum(round_["loop_cpu_s"] for round_ in rounds) / tokens
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: a random-weight catalog model)")
    parser.add_argument("--catalog-model", default="qwen3.5-4b", help="catalog geometry of the random model")
    parser.add_argument("--full-size", action="store_true", help="the catalog model at full size instead of tiny")
    parser.add_argument("--device", default="auto", help="auto (GPU when visible), cpu or cuda")
    parser.add_argument("--concurrency", type=int, default=32, help="streams at once = max_num_seqs")
    parser.add_argument("--requests", type=int, default=96, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measured rounds per mode")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=int, default=64 * 1024**2)
    parser.add_argument("--out", type=Path,
                        default=Path(f"bench/results/grpc_load-{datetime.date.today().isoformat()}.json"),
                        help="where to write the results (JSON)")
    args = parser.parse_args()
    for name in ("concurrency", "requests", "rounds", "prompt_tokens", "output_tokens"):
        if not 1 <= getattr(args, name) <= 4096:
            parser.error(f"--{name.replace('_', '-')} must be in [1, 4096]")
    if args.prompt_tokens + args.output_tokens > args.max_model_len:
        parser.error("--prompt-tokens + --output-tokens must fit in --max-model-len")

    from hybridkv.sidecar.core.config import EngineConfig

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from hybridkv.sidecar.random_checkpoint import make_model
            from hybridkv.sizing import catalog_geometry

            model_dir = make_model(Path(scratch) / "model", catalog_geometry(args.catalog_model), seed=0,
                                   tiny=not args.full_size)
        engine_config = EngineConfig(
            model=str(model_dir), max_num_seqs=args.concurrency, max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_cache_memory,
            device=args.device,
        )
        from hybridkv.sidecar.core.engine import Engine

        engine = Engine(engine_config)
        vocab = engine.geometry.vocab_size
        device_name = str(engine.device)
        if engine.device.type == "cuda":
            import torch

            device_name = torch.cuda.get_device_name(engine.device)
        print(f"{args.rounds} rounds x {args.requests} requests, {args.concurrency} at once, {args.prompt_tokens} "
              f"prompt + {args.output_tokens} output tokens; in-process engine and gRPC alternate", flush=True)
        in_process_rounds, grpc_rounds = [], []
        with SidecarProcess(args, model_dir) as sidecar:
            # One short warm-up round each, so first-call costs (allocator, lazy init) stay out of the figures.
            run_in_process(engine, args, args.concurrency, 4)
            asyncio.run(_grpc_round(args, sidecar.target, vocab, args.concurrency, 4))
            for round_index in range(args.rounds):
                in_process_rounds.append(run_in_process(engine, args, args.requests, args.output_tokens))
                process_cpu_s, loop_cpu_s = sidecar.cpu_seconds()
                grpc_round = asyncio.run(_grpc_round(args, sidecar.target, vocab, args.requests, args.output_tokens))
                process_cpu_after_s, loop_cpu_after_s = sidecar.cpu_seconds()
                grpc_round["cpu_s"] = process_cpu_after_s - process_cpu_s
                grpc_round["loop_cpu_s"] = loop_cpu_after_s - loop_cpu_s
                grpc_rounds.append(grpc_round)
                print(f"  round {round_index + 1}/{args.rounds} done", flush=True)
        in_process = pooled("in-process", in_process_rounds, args.requests)
        over_grpc = pooled("grpc", grpc_rounds, args.requests)

    latency_overhead = (over_grpc["itl_ms"]["p50"] - in_process["itl_ms"]["p50"]) / in_process["itl_ms"]["p50"]
    cpu_overhead = (over_grpc["cpu_us_per_token"] - in_process["cpu_us_per_token"]) / in_process["cpu_us_per_token"]
    header = f"{'mode':<11} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'p90':>7} {'p99':>7} " \
             f"{'ITL p50':>8} {'p90':>7} {'p99':>7} {'CPU/token':>10}"
    print("\n" + header + "\n" + " " * 36 + "(ms)" + " " * 32 + "(us)")
    for row in (in_process, over_grpc):
        print(f"{row['mode']:<11} {row['requests_per_s']:>7.2f} {row['output_tokens_per_s']:>8.1f} "
              f"{row['ttft_ms']['p50']:>9.1f} {row['ttft_ms']['p90']:>7.1f} {row['ttft_ms']['p99']:>7.1f} "
              f"{row['itl_ms']['p50']:>8.2f} {row['itl_ms']['p90']:>7.2f} {row['itl_ms']['p99']:>7.2f} "
              f"{row['cpu_us_per_token']:>10.0f}")
    print(f"\ngRPC overhead on median inter-token time: {100 * latency_overhead:+.1f}% (target < 5%)")
    print(f"gRPC server CPU per output token over the in-process engine: {100 * cpu_overhead:+.1f}% "
          f"(event loop alone: {over_grpc['event_loop_cpu_us_per_token']:.0f} us per token)")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": device_name},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "in_process": in_process,
        "grpc": over_grpc,
        "itl_p50_overhead_fraction": latency_overhead,
        "cpu_per_token_overhead_fraction": cpu_overhead,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
