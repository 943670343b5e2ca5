"""Where a decode step's device time goes: per-kernel GPU time of the engine's decode steps, by batch size.

The engine runs eagerly here (CUDA graphs off) so the profiler sees every kernel; kernel times are the same inside a
graph, which only removes the launch gaps. For each batch size B: B requests of `--prompt-len` random tokens are
prefilled, then `--steps` decode steps run under torch.profiler. Printed per batch size: the kernels by GPU time per
step, and each one's share; the sum is the step's device time without launch gaps, to set against the
throughput benchmark's ms/step and the roofline.

    python bench/decode_profile.py --out decode_profile.json          # Qwen3.5-4B geometry, bf16, on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402  (the shared checkpoint, prompts and engine flags)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    throughput.add_engine_args(parser, batch_sizes="1,64,256", max_num_seqs=256)
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled per batch size")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per batch size")
    parser.add_argument("--out", default="decode_profile.json", help="where to write the results (JSON)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        parser.error(f"--steps and --top must be at least 1, got {args.steps} and {args.top}")
    return args


def profile_decode(engine, prompts: list[list[int]], steps: int) -> dict[str, tuple[float, float]]:
    """Per kernel name: (µs per step, launches per step) over `steps` decode steps of `prompts`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hybridkv.sidecar.core.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"profile-{len(prompts)}-{index}", prompt, params)
    # Prefill until every request decodes (and one decode step more, so no prefill is still in flight).
    while len(engine.scheduler.running) < len(prompts) or any(
            seq.num_uncomputed_tokens != 1 for seq in engine.scheduler.running):
        engine.step()
    engine.step()
    on_cuda = engine.device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_cuda else lambda: None
    synchronize()
    # On CPU (a smoke run of this script) the operators' own CPU time stands in for kernel time.
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            engine.step()
        synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type.name == activity.name:
            totals[event.name][0] += (event.device_time if on_cuda else event.self_cpu_time_total) / steps
            totals[event.name][1] += 1 / steps
    while engine.has_unfinished_requests():
        engine.step()
    return {name: (us, count) for name, (us, count) in totals.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.core.engine import Engine

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/decode_profile.py profiles GPU kernels; no CUDA device is visible", file=sys.stderr)
        return 2
    folder = throughput.ensure_checkpoint(args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = Engine(EngineConfig(
        model=folder, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=True, seed=args.seed,
        min_prefill_tokens_with_decodes=0,  # steps as scheduled, none held back (a serving policy)
    ))
    vocab = engine.geometry.vocab_size
    result = {"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": args.model,
              "prompt_len": args.prompt_len, "steps": args.steps, "batches": []}
    for batch in batch_sizes:
        prompts = throughput.random_prompts(batch, args.prompt_len, vocab, args.seed + batch)
        kernels = profile_decode(engine, prompts, args.steps)
        total = sum(us for us, _ in kernels.values())
        ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
        result["batches"].append({"batch": batch, "kernel_us_per_step": total,
                                  "launches_per_step": sum(count for _, count in kernels.values()),
                                  "kernels": [{"name": name, "us_per_step": us, "launches_per_step": count}
                                              for name, (us, count) in ranked]})
        print(f"\nbatch {batch}: {total / 1000:.2f} ms of kernels per decode step, "
              f"{sum(c for _, c in kernels.values()):.0f} launches\n")
        print("| kernel | µs/step | launches/step | share |")
        print("|---|---:|---:|---:|")
        for name, (us, count) in ranked[: args.top]:
            print(f"| `{name[:80]}` | {us:.1f} | {count:.0f} | {100 * us / total:.1f}% |")
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
        handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
