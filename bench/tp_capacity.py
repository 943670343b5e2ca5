"""Measured capacity of every tensor-parallel rank against the planner's per-rank prediction (`hybridkv plan --json`).

Starts the engine on a random checkpoint of a catalog geometry (bf16), reads each rank's measured budget, reserve,
weights, token blocks and state slots, then asks `hybridkv plan` for the same model, GPU memory (the measured total),
tensor-parallel size and engine settings, and prints both with the planner's error per rank. Every rank must hold
the same state slots and token blocks (rank 0's scheduler hands out ids valid on all): the script exits 1 if not.

    python bench/tp_capacity.py --model qwen3.6-27b --tensor-parallel-size 2 --max-model-len 32768
    python bench/tp_capacity.py --device cpu --tiny --tensor-parallel-size 2 --kv-cache-memory 67108864  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# `python -P` leaves this script's folder off sys.path; throughput imports no hybridkv at module level.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402

COMPARED_KEYS = ("budget_bytes", "reserve_bytes", "weights_bytes", "token_blocks", "token_capacity", "state_slots",
                 "token_pool_bytes", "state_pool_bytes")
PLAN_TIMEOUT_S = 120


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3.6-27b", help="catalog geometry of the random checkpoint")
    parser.add_argument("--checkpoint", help="checkpoint folder (random bf16 weights are written there if it has none)")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", type=int, help="fixed per-rank cache budget in bytes (needed on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-format", choices=("safetensors", "random"), default="safetensors",
                        help="random: each rank builds its shard of the seeded random weights in device memory; the "
                        "folder needs only config.json and the tokenizer")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a few-MB scaled-down model (smoke runs, not figures)")
    parser.add_argument("--out", default="tp_capacity.json")
    return parser.parse_args(argv)


def plan(args, folder: str, total_memory_bytes: int) -> dict:
    """The planner's answer for these settings, from the same CLI a user runs."""
    command = [sys.executable, "-P", "-m", "hybridkv", "plan", "--model-config", os.path.join(folder, "config.json"),
               "--gpu-memory-mib", str(total_memory_bytes // 2**20), "--tp", str(args.tensor_parallel_size),
               "--max-gpus", str(args.tensor_parallel_size), "--max-concurrency", str(args.max_num_seqs),
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--json"]
    if args.kv_cache_memory is not None:
        command += ["--kv-cache-memory", str(args.kv_cache_memory)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=PLAN_TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"hybridkv plan failed ({done.returncode}): {done.stderr.strip()}")
    return {"command": " ".join(command[3:]), **json.loads(done.stdout)}


def compare(measured: dict, planned: dict) -> dict:
    return {key: {"measured": measured[key], "predicted": planned[key],
                  "error_pct": 100.0 * (planned[key] - measured[key]) / measured[key] if measured[key] else None}
            for key in COMPARED_KEYS}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.core.engine import Engine

    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tensor_parallel_size:
        print(f"needs {args.tensor_parallel_size} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    folder = throughput.ensure_checkpoint(args)
    started = time.perf_counter()
    engine = Engine(EngineConfig(
        model=folder, device=args.device, tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory, seed=args.seed, load_format=args.load_format,
        enable_prefix_caching=True,  # as `hybridkv serve` and `hybridkv plan` run by default
    ))
    startup_s = time.perf_counter() - started
    try:
        report = engine.capacity().to_dict()
        total_memory_bytes = engine.memory.total_memory_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES")
        measured_on_device = engine.memory.measured
    finally:
        engine.close()
    planned = plan(args, folder, total_memory_bytes)
    ranks = report["per_rank"]
    equal_slots = len({rank["state_slots"] for rank in ranks}) == 1
    equal_blocks = len({rank["token_blocks"] for rank in ranks}) == 1
    result = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "tiny": args.tiny,
        "tensor_parallel_size": args.tensor_parallel_size,
        "startup_s": startup_s,
        "memory_measured": measured_on_device,
        "total_memory_bytes": total_memory_bytes,
        "per_rank": ranks,
        "plan": planned,
        "comparison_per_rank": [compare(rank, planned) for rank in ranks],
        "state_slots_equal_across_ranks": equal_slots,
        "token_blocks_equal_across_ranks": equal_blocks,
    }
    throughput.write_json(args.out, result)
    print(f"\n{args.model}{' (tiny: a smoke run)' if args.tiny else ''}, tp={args.tensor_parallel_size}, "
          f"{result['device']}; `{result['command']}`; planner: `{planned['command']}`\n")
    print("| rank | key | measured | predicted (plan) | error |")
    print("|---:|---|---:|---:|---:|")
    for tp_rank, rows in enumerate(result["comparison_per_rank"]):
        for key, row in rows.items():
            unmeasured = row["error_pct"] is None or (key == "reserve_bytes" and not measured_on_device)
            error = "n/a" if unmeasured else f"{row['error_pct']:+.2f}%"
            print(f"| {tp_rank} | {key} | {row['measured']:,} | {row['predicted']:,} | {error} |")
    print(f"\nstate slots equal on every rank: {equal_slots}; token blocks equal: {equal_blocks}")
    return 0 if equal_slots and equal_blocks else 1


if __name__ == "__main__":
    throughput.run_script(main)
