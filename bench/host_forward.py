"""The host cost of the model's eager forward, launches aside: what our Python and torch's dispatch spend on a step.

An eager mixed step (decodes beside a prefill chunk) is launch-bound on the GPU: the host takes longer to issue its
kernels than the device takes to run them (docs/performance.md). Part of that host time is the launches themselves
(Triton's launcher, cuBLAS); the rest is the model's own Python and the small torch ops around them. This measures
the rest on any CPU: the model is built at a catalog model's layer structure (its layer count and the order of GDN
and attention layers) with a few-MB width, the Triton kernels are dispatched exactly as on a GPU but every launch is
counted and skipped, and each GEMM returns an empty output of its shape, so what is timed is everything but the
kernels. The counts say what the launches add on a given GPU host (times its per-launch cost).

    python bench/host_forward.py --out host_forward.json
    python bench/host_forward.py --batch-sizes 64 --prefill-tokens 256 --profile 25   # the costliest functions
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_step  # noqa: E402
import throughput  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3.5-4b", help="catalog model whose layer structure is built")
    parser.add_argument("--batch-sizes", default="16,64,256", help="decoding requests per step (comma-separated)")
    parser.add_argument("--prefill-tokens", default="0,64,256",
                        help="tokens of the one prefill chunk beside them (comma-separated; 0: a decode step)")
    parser.add_argument("--steps", type=int, default=20, help="forwards timed per row")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list the N functions with the most own host time (cProfile)")
    parser.add_argument("--out", default="host_forward.json")
    args = parser.parse_args(argv)
    try:
        args.batch_list = [int(b) for b in args.batch_sizes.split(",")]
        args.prefill_list = [int(p) for p in args.prefill_tokens.split(",")]
    except ValueError:
        parser.error("--batch-sizes and --prefill-tokens take comma-separated integers")
    if min(args.batch_list) < 0 or min(args.prefill_list) < 0 or args.steps < 1 or args.profile < 0:
        parser.error("batch sizes and prefill tokens must not be negative, --steps must be positive")
    if any(b == 0 and p == 0 for b in args.batch_list for p in args.prefill_list):
        parser.error("a step needs a decoding request or prefill tokens")
    return args


class StubbedLaunches:
    """Counts and skips every Triton launch and GEMM while active (Triton's JIT and autotuner entry points and
    torch's linear are swapped for counters and restored on exit)."""

    def __init__(self):
        self.triton: Counter[str] = Counter()
        self.gemms = 0

    def __enter__(self):
        import torch
        import torch.nn.functional as F
        from triton.runtime import autotuner, interpreter, jit

        # Under TRITON_INTERPRET=1 the kernels are InterpretedFunctions, launched through their own run.
        self._saved = [(jit.JITFunction, "run", jit.JITFunction.run),
                       (interpreter.InterpretedFunction, "run", interpreter.InterpretedFunction.run),
                       (autotuner.Autotuner, "run", autotuner.Autotuner.run),
                       (autotuner.Heuristics, "run", autotuner.Heuristics.run),
                       (F, "linear", F.linear)]
        counts = self

        def jit_run(kernel, *args, grid, warmup, **kwargs):
            counts.triton[kernel.__name__] += 1

        def tuned_run(tuner, *args, **kwargs):  # fla's autotuned kernels: counted once, not again by the JIT stub
            counts.triton[tuner.fn.__name__] += 1
            tuner.best_config = tuner.configs[0]  # its pick, as a run leaves it (later launches skip the wrappers)

        def linear(x, weight, bias=None):
            counts.gemms += 1
            return torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)

        jit.JITFunction.run = interpreter.InterpretedFunction.run = jit_run
        autotuner.Autotuner.run = tuned_run
        autotuner.Heuristics.run = lambda heuristics, *args, **kwargs: heuristics.fn.run(*args, **kwargs)
        F.linear = linear
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def build_model(catalog_name: str):
    """The catalog model's layer structure at the random checkpoints' tiny width, on the CPU, with its pools."""
    import torch

    from hybridkv.sidecar.model.qwen3_5 import Qwen3_5ForCausalLM
    from hybridkv.sidecar.random_checkpoint import build_config
    from hybridkv.sizing import catalog_geometry
    from hybridkv.sizing.geometry import geometry_from_config

    source = catalog_geometry(catalog_name)
    geometry = geometry_from_config(build_config(source, tiny=True,
                                                 overrides={"num_hidden_layers": source.num_hidden_layers}))
    model = Qwen3_5ForCausalLM(geometry, torch.bfloat16, "cpu")
    return model, geometry


def bind_pools(model, slots: int, blocks: int, block_size: int) -> None:
    import torch

    conv_shape, ssm_shape = model.state_cache_shapes(slots)
    kv_shape = model.kv_cache_shape(blocks, block_size)
    model.bind_caches(
        [(torch.zeros(kv_shape, dtype=model.dtype), torch.zeros(kv_shape, dtype=model.dtype))
         for _ in model.attention_layers],
        [(torch.zeros(conv_shape, dtype=model.dtype), torch.zeros(ssm_shape, dtype=torch.float32))
         for _ in model.gdn_layers])


def step_inputs(batch: int, prefill: int, block_size: int = 16, context: int = 1024):
    """Input ids, positions and the batch context of `batch` decodes at `context` tokens beside one prefill chunk of
    `prefill` tokens, on slots 1.. (none on the null slot)."""
    import torch

    from hybridkv.sidecar.model.context import BatchContext

    query_lens = [1] * batch + ([prefill] if prefill else [])
    seq_lens = [context] * batch + ([prefill] if prefill else [])
    cu_seqlens = [0]
    for query_len in query_lens:
        cu_seqlens.append(cu_seqlens[-1] + query_len)
    tokens, seqs = cu_seqlens[-1], len(query_lens)
    width = -(-max(seq_lens) // block_size)
    ctx = BatchContext(
        num_decodes=batch, cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32), cu_seqlens_q_cpu=cu_seqlens,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.ones(seqs, width, dtype=torch.int32), slot_mapping=torch.zeros(tokens, dtype=torch.long),
        state_slot_ids=torch.arange(1, seqs + 1, dtype=torch.int32), max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens), prefill_on_null_slot=False)
    return torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, dtype=torch.long), ctx


def measure(model, batch: int, prefill: int, steps: int, profile: int) -> dict:
    import torch

    input_ids, positions, _ = step_inputs(batch, prefill)
    with torch.inference_mode(), StubbedLaunches() as launches:
        for _ in range(2):  # first calls import and cache
            model(input_ids, positions, step_inputs(batch, prefill)[2])
        launches.triton.clear()
        launches.gemms = 0
        seconds = 0.0
        for _ in range(steps):
            ctx = step_inputs(batch, prefill)[2]  # a fresh context per step, as the runner builds one
            started = time.perf_counter()
            model(input_ids, positions, ctx)
            seconds += time.perf_counter() - started
        triton = {name: count / steps for name, count in launches.triton.most_common()}
        gemms = launches.gemms / steps
        top = None
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(steps):
                model(input_ids, positions, step_inputs(batch, prefill)[2])
            profiler.disable()
            top = host_step.top_functions(profiler, profile, steps)
    row = {"batch": batch, "prefill_tokens": prefill, "forward_host_ms": 1000 * seconds / steps,
           "triton_launches_per_step": sum(triton.values()), "gemms_per_step": gemms, "triton_launches": triton}
    if top is not None:
        row["profile"] = top
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    model, geometry = build_model(args.model)
    bind_pools(model, slots=max(args.batch_list) + 2, blocks=128, block_size=16)
    saved_mode, saved_threads = os.environ.get("HYBRIDKV_KERNELS"), torch.get_num_threads()
    os.environ["HYBRIDKV_KERNELS"] = "triton"  # the GPU's dispatch, with the launches stubbed out
    torch.set_num_threads(1)
    try:
        rows = [measure(model, batch, prefill, args.steps, args.profile)
                for batch in args.batch_list for prefill in args.prefill_list if batch or prefill]
    finally:
        torch.set_num_threads(saved_threads)
        if saved_mode is None:
            os.environ.pop("HYBRIDKV_KERNELS", None)
        else:
            os.environ["HYBRIDKV_KERNELS"] = saved_mode
    result = {"model": args.model, "num_hidden_layers": geometry.num_hidden_layers, "steps": args.steps,
              "python": sys.version.split()[0], "torch": torch.__version__, "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"{'batch':>6} {'prefill':>8} {'host ms':>8} {'Triton launches':>16} {'GEMMs':>6}")
    for row in rows:
        print(f"{row['batch']:>6} {row['prefill_tokens']:>8} {row['forward_host_ms']:>8.2f} "
              f"{row['triton_launches_per_step']:>16.0f} {row['gemms_per_step']:>6.0f}")
    for row in rows:
        if "profile" in row:
            host_step.print_profile(f"batch {row['batch']}, prefill {row['prefill_tokens']}: own host time per step "
                                    "(cProfile)", row["profile"])
    return 0


if __name__ == "__main__":
    throughput.run_script(main)
