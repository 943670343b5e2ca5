"""Where a decode step's device time goes: per-kernel GPU time of the engine's decode steps, by batch size, and
with `--prefill-tokens`, of mixed steps (the decodes beside one prompt prefilling that many tokens a step).

The engine runs eagerly by default (CUDA graphs off) so every kernel is its own launch; kernel times are the same
inside a graph, which only removes the launch gaps. `--cuda-graphs` profiles the engine as it serves (decode steps
whole, mixed steps piecewise; the profiler still sees the kernels inside the graphs). For each batch size B: B
requests of `--prompt-len` random tokens are prefilled, then `--steps` steps run unprofiled, timed by the host
clock, and `--steps` more under torch.profiler. Printed per batch size: the kernels by GPU time per step and each
one's share; the kernels' sum is the step's device time, and the gap to the host-timed step is what launching and
host work add where the device waits for them.

    python bench/decode_profile.py --out decode_profile.json          # Qwen3.5-4B geometry, bf16, on the GPU
    python bench/decode_profile.py --cuda-graphs --batch-sizes 64,256 --max-num-seqs 257 --prefill-tokens 256 \\
        --max-model-len 32768 --load-format random
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402  (the shared checkpoint, prompts and engine flags)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    throughput.add_engine_args(parser, batch_sizes="1,64,256", max_num_seqs=256)
    throughput.add_load_format_arg(parser)
    parser.add_argument("--steps", type=int, default=8, help="steps timed and then profiled per batch size")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per batch size")
    parser.add_argument("--prefill-tokens", type=int, default=0, metavar="P",
                        help="profile mixed steps: one prompt prefills P tokens a step beside the decodes (0: decode "
                        "steps only)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the engine as it serves: decode steps replay CUDA graphs, mixed steps piecewise ones")
    parser.add_argument("--out", default="decode_profile.json", help="where to write the results (JSON)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.top < 1 or args.prefill_tokens < 0:
        parser.error(f"--steps and --top must be at least 1 and --prefill-tokens at least 0, got {args.steps}, "
                     f"{args.top} and {args.prefill_tokens}")
    try:
        args.batch_size_list = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}")
    if min(args.batch_size_list) < 1 or max(args.batch_size_list) + (args.prefill_tokens > 0) > args.max_num_seqs:
        parser.error("every batch size must be at least 1 and fit --max-num-seqs (with one slot more for the "
                     "prompt of --prefill-tokens)")
    # The prompt must still be prefilling after the timed and the profiled steps (and the steps that admit it).
    if args.prefill_tokens and args.prefill_tokens * (2 * args.steps + 2) >= args.max_model_len:
        parser.error(f"--max-model-len must exceed --prefill-tokens x (2 x --steps + 2) = "
                     f"{args.prefill_tokens * (2 * args.steps + 2)}, so the prompt outlasts the profiled steps")
    return args


def profile_steps(engine, prompts: list[list[int]], steps: int, prefill_tokens: int = 0) -> dict:
    """`steps` steps of `prompts` decoding (beside one prompt prefilling `prefill_tokens` a step, if not 0), timed
    by the host clock, then `steps` more under torch.profiler. -> host ms per step, the kinds of the 2 x `steps`
    steps, and per kernel name (µs per step, launches per step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hybridkv.sidecar.core.sampling import SamplingParams

    scheduler = engine.scheduler
    ids = [f"profile-{len(prompts)}-{index}" for index in range(len(prompts))]
    # Enough tokens to outlast the steps that admit the others (long prompts take several steps to prefill).
    admission = throughput.prefill_steps(engine, len(prompts), max(len(prompt) for prompt in prompts))
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8 + admission, ignore_eos=True)
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    throughput.until_decoding(engine, ids)
    engine.step()  # one decode step more, so no prefill is still in flight
    if prefill_tokens:
        scheduler.max_prefill_tokens_with_decodes = prefill_tokens
        vocab = engine.geometry.vocab_size
        prompt = throughput.random_prompts(1, prefill_tokens * (2 * steps + 2), vocab, len(prompts))[0]
        engine.add_request("profile-prefill", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        engine.step()  # admits it; its first chunk runs here
    on_cuda = engine.device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_cuda else lambda: None
    kinds_before = dict(engine.steps_by_kind)
    synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize()
    host_ms = 1000 * (time.perf_counter() - started) / steps
    # On CPU (a smoke run of this script) the operators' own CPU time stands in for kernel time.
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            engine.step()
        synchronize()
    kinds = {kind: engine.steps_by_kind[kind] - kinds_before[kind] for kind in kinds_before}
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type.name == activity.name:
            totals[event.name][0] += (event.device_time if on_cuda else event.self_cpu_time_total) / steps
            totals[event.name][1] += 1 / steps
    for request_id in ids + (["profile-prefill"] if prefill_tokens else []):
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    scheduler.max_prefill_tokens_with_decodes = scheduler.max_num_batched_tokens
    return {"host_ms_per_step": host_ms, "steps_by_kind": kinds,
            "kernels": {name: (us, count) for name, (us, count) in totals.items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.core.engine import Engine

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/decode_profile.py profiles GPU kernels; no CUDA device is visible", file=sys.stderr)
        return 2
    folder = throughput.ensure_checkpoint(args)
    engine = Engine(EngineConfig(
        model=folder, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max(args.batch_size_list) + args.prefill_tokens),
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=not args.cuda_graphs, seed=args.seed,
        load_format=args.load_format,
        min_prefill_tokens_with_decodes=0,  # steps as scheduled, none held back (a serving policy)
    ))
    vocab = engine.geometry.vocab_size
    result = {"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": args.model,
              "prompt_len": args.prompt_len, "steps": args.steps, "prefill_tokens": args.prefill_tokens,
              "cuda_graphs": args.cuda_graphs, "batches": []}
    step_kind = f"mixed step ({args.prefill_tokens} prefill tokens)" if args.prefill_tokens else "decode step"
    try:
        for batch in args.batch_size_list:
            prompts = throughput.random_prompts(batch, args.prompt_len, vocab, args.seed + batch)
            profiled = profile_steps(engine, prompts, args.steps, args.prefill_tokens)
            kernels = profiled["kernels"]
            total = sum(us for us, _ in kernels.values())
            ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
            host_ms = profiled["host_ms_per_step"]
            result["batches"].append({"batch": batch, "kernel_us_per_step": total, "host_ms_per_step": host_ms,
                                      "steps_by_kind": profiled["steps_by_kind"],
                                      "launches_per_step": sum(count for _, count in kernels.values()),
                                      "kernels": [{"name": name, "us_per_step": us, "launches_per_step": count}
                                                  for name, (us, count) in ranked]})
            print(f"\nbatch {batch}: {total / 1000:.2f} ms of kernels per {step_kind} against {host_ms:.2f} ms "
                  f"by the host clock, {sum(c for _, c in kernels.values()):.0f} launches "
                  f"(timed and profiled steps: {profiled['steps_by_kind']})\n")
            print("| kernel | µs/step | launches/step | share |")
            print("|---|---:|---:|---:|")
            for name, (us, count) in ranked[: args.top]:
                print(f"| `{name[:80]}` | {us:.1f} | {count:.0f} | {100 * us / total:.1f}% |")
    finally:
        engine.close()
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
        handle.write("\n")
    return 0


if __name__ == "__main__":
    throughput.run_script(main)
