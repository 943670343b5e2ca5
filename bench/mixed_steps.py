"""What a decode step costs when prefill runs in it: the measurement behind `--max-prefill-tokens-with-decodes`.

For each decode batch B and prefill budget P: B requests decode while one long prompt is prefilled P tokens a step
(the scheduler's prefill budget set to P), and the steps that hold both are timed. Each row reports the mean step
time (what every decoding request waits per token, its TPOT), its ratio to a pure-decode step at the same batch,
and the prefill rate those steps give. Choosing P is choosing a row: the smallest P whose prefill rate keeps up with
arrivals bounds TPOT closest to the pure-decode step.

    python bench/mixed_steps.py --out mixed_steps.json                 # Qwen3.5-4B geometry, bf16, on the GPU
    python bench/mixed_steps.py --device cpu --tiny --batch-sizes 2 --prefill-budgets 8,32 --steps 3 \\
        --max-num-seqs 4 --max-model-len 512 --prompt-len 16           # CPU smoke run, figures meaningless
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 256 decoders and the probe prompt beside them; probe prompts long enough for several 8k-token steps.
    throughput.add_engine_args(parser, batch_sizes="16,64,256", max_num_seqs=257)
    parser.set_defaults(max_model_len=32768)
    throughput.add_load_format_arg(parser)
    parser.add_argument("--prefill-budgets", default="256,512,1024,2048,4096,8192",
                        help="prefill tokens per step while decodes run (comma-separated)")
    parser.add_argument("--steps", type=int, default=10, help="mixed steps timed per row")
    parser.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None, metavar="T",
                        help="the engine's (default: its own); with graphs, every row is timed eagerly too")
    parser.add_argument("--out", default="mixed_steps.json")
    args = parser.parse_args(argv)
    try:
        args.batch_size_list = [int(b) for b in args.batch_sizes.split(",")]
        args.budget_list = [int(p) for p in args.prefill_budgets.split(",")]
    except ValueError:
        parser.error("--batch-sizes and --prefill-budgets take comma-separated integers")
    if min(args.batch_size_list + args.budget_list + [args.steps]) < 1:
        parser.error("batch sizes, prefill budgets and --steps must be positive")
    if max(args.batch_size_list) >= args.max_num_seqs:
        parser.error("every batch size must leave a state slot for the prompt being prefilled: raise --max-num-seqs")
    if max(args.budget_list) >= args.max_model_len - 2:
        parser.error("--max-model-len must exceed every prefill budget by more than two tokens, so the probe prompt "
                     "outlasts its first step")
    return args


def _sync(engine) -> None:
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def time_steps(engine, prefill_prompt: list[int] | None, steps: int) -> dict:
    """Mean time of up to `steps` engine steps of the running decoders and, with `prefill_prompt`, of a new request
    prefilling under the scheduler's budget (aborted afterwards): only steps that still prefill it are timed, so a
    prompt shorter than the steps' budget ends the timing early (`steps` in the result says how many ran)."""
    from hybridkv.sidecar.core.sampling import SamplingParams

    seq = None
    if prefill_prompt is not None:
        engine.add_request("prefill", prefill_prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        engine.step()  # admits it; its first chunk runs in this untimed step
        # The request's sequence object keeps its count of computed tokens after it finishes.
        seq = next(seq for seq in engine.scheduler.live_sequences() if seq.request_id == "prefill")
    _sync(engine)
    kinds_before = dict(engine.steps_by_kind)
    started = time.perf_counter()
    prefill_before = seq.num_computed_tokens if seq is not None else 0
    timed = 0
    while timed < steps and (seq is None or seq.num_computed_tokens < len(prefill_prompt)):
        engine.step()
        timed += 1
    _sync(engine)
    elapsed_s = time.perf_counter() - started
    prefilled = seq.num_computed_tokens - prefill_before if seq is not None else 0
    kinds = {kind: engine.steps_by_kind[kind] - kinds_before[kind] for kind in kinds_before}
    if seq is not None:
        engine.abort("prefill")
        engine.step()
    return {"step_ms": 1000 * elapsed_s / timed, "steps": timed, "steps_by_kind": kinds,
            "prefill_tokens_per_s": prefilled / elapsed_s if prefilled else 0.0}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.core.engine import Engine
    from hybridkv.sidecar.core.sampling import SamplingParams

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/mixed_steps.py measures GPU step times; no CUDA device is visible", file=sys.stderr)
        return 2
    folder = throughput.ensure_checkpoint(args)
    # One engine for every row: the prefill budget is the scheduler's, set per row; the decoders' own prompts are
    # prefilled at the full step budget.
    engine = Engine(EngineConfig(
        model=folder, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max(args.batch_size_list) + max(args.budget_list)),
        gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed, load_format=args.load_format,
        min_prefill_tokens_with_decodes=0,  # steps as scheduled, none held back (a serving policy)
        **({} if args.piecewise_cuda_graph_max_tokens is None else
           {"piecewise_cuda_graph_max_tokens": args.piecewise_cuda_graph_max_tokens}),
    ))
    runner = engine.runner
    piecewise = runner.piecewise
    scheduler = engine.scheduler
    vocab = engine.geometry.vocab_size
    rows = []
    try:
        for batch in args.batch_size_list:
            decoders = [f"decode-{batch}-{index}" for index in range(batch)]
            # Enough tokens for the pure and mixed timings of every budget (twice: with graphs and eagerly), each
            # followed by one step of aborts.
            long_enough = (2 * len(args.budget_list) + 1) * (args.steps + 2) + throughput.prefill_steps(
                engine, batch, args.prompt_len)
            for request_id, prompt in zip(decoders, throughput.random_prompts(batch, args.prompt_len, vocab,
                                                                               args.seed + batch)):
                engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=long_enough,
                                                                      ignore_eos=True))
            throughput.until_decoding(engine, decoders)
            pure = time_steps(engine, None, args.steps)
            for budget in args.budget_list:
                scheduler.max_prefill_tokens_with_decodes = budget
                # Long enough that its prefill outlasts the timed steps where max_model_len allows.
                prefill_len = min(args.max_model_len - 2, budget * (args.steps + 2))
                prefill_prompt = throughput.random_prompts(1, prefill_len, vocab, args.seed + 7)[0]
                mixed = time_steps(engine, prefill_prompt, args.steps)
                row = {"batch": batch, "prefill_budget": budget, "pure_decode_step_ms": pure["step_ms"],
                       "mixed_step_ms": mixed["step_ms"], "ratio": mixed["step_ms"] / pure["step_ms"],
                       "prefill_tokens_per_s": mixed["prefill_tokens_per_s"], "mixed_steps": mixed["steps"],
                       "pure_steps_by_kind": pure["steps_by_kind"], "mixed_steps_by_kind": mixed["steps_by_kind"],
                       "piecewise": piecewise is not None and batch + budget <= piecewise.max_tokens}
                if row["piecewise"]:  # the same steps launched eagerly, on the same engine
                    runner.piecewise = None
                    try:
                        eager = time_steps(engine, prefill_prompt, args.steps)
                    finally:
                        runner.piecewise = piecewise
                    row.update(eager_mixed_step_ms=eager["step_ms"],
                               eager_prefill_tokens_per_s=eager["prefill_tokens_per_s"])
                scheduler.max_prefill_tokens_with_decodes = scheduler.max_num_batched_tokens
                rows.append(row)
            for request_id in decoders:
                engine.abort(request_id)
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.close()
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    result = {"model": args.model, "tiny": args.tiny, "device": device_name, "steps": args.steps, "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"{'batch':>6} {'prefill/step':>13} {'decode step ms':>15} {'mixed step ms':>14} {'ratio':>6} "
          f"{'prefill tok/s':>14} {'steps':>6} {'eager mixed ms':>15}")
    for row in rows:
        eager = f"{row['eager_mixed_step_ms']:>15.2f}" if "eager_mixed_step_ms" in row else f"{'-':>15}"
        print(f"{row['batch']:>6} {row['prefill_budget']:>13} {row['pure_decode_step_ms']:>15.2f} "
              f"{row['mixed_step_ms']:>14.2f} {row['ratio']:>6.2f} {row['prefill_tokens_per_s']:>14.0f} "
              f"{row['mixed_steps']:>6} {eager}")
    return 0


if __name__ == "__main__":
    throughput.run_script(main)
