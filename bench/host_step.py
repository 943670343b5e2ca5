"""Where an engine step's host time goes at B decoding requests: the scheduler, the step's device tensors (the
runner's one packed host-to-device copy), the model's forward or its CUDA-graph replay, the logits and the sampler
(on a GPU: their launches, as the device runs them asynchronously; on CPU: their compute too), and turning sampled
ids into outputs (detokenizing, stop checks, the scheduler's bookkeeping).

With the engine's step overlap the host prepares step n+1 while the device runs step n, so the host parts other than
the launches bound the step time only where they exceed the device's own time for the step; this measures them.
Each part is the wall time of the engine's own method, wrapped, over --steps pure decode steps after every request's
prefill; `other` is the rest of `Engine.step` (its loop, the wait for the device, the inbox). With --prefill-tokens P
every timed step is a mixed one instead: one long prompt prefills P tokens a step beside the B decodes, which runs
the model eagerly; on a GPU its `forward` is then the host's launch time of the whole eager forward, and a forward
near the step time means the mixed steps are launch-bound. --profile N also runs the timed steps under cProfile and
prints (and writes) the N functions with the most host time of their own, which names what the launches spend.
--module-times adds, without a profiler's overhead, the host time of each kind of model module per step (token
mixers, MLPs, norms, projections; forward hooks, so a mixer's time includes its projections' and norms'): on a GPU,
what the launches of each part of an eager forward cost.

    python bench/host_step.py --out host_step.json                    # Qwen3.5-4B geometry, bf16, on the GPU
    python bench/host_step.py --prefill-tokens 512 --out host_step_mixed.json   # mixed steps, on the GPU
    python bench/host_step.py --device cpu --tiny --batch-sizes 16,64,256 --max-num-seqs 256 --max-model-len 1024 \\
        --prompt-len 64 --out host_step.json                          # the host parts on CPU (model time is CPU's)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402

# (part, object attribute path, method): each wrapped method's wall time is added to its part.
PARTS = (
    ("schedule", "scheduler", "schedule"),
    ("batch", "runner", "_prepare"),
    ("batch", "runner", "_stage_decode"),  # a pure decode step on the GPU packs its inputs for the graph instead
    ("forward", "runner.model", "forward"),
    ("forward", "runner", "_replay"),  # ... and replays its CUDA graph
    ("logits", "runner.model", "compute_logits"),
    ("sample", "sampler", "sample"),
    ("outputs", "", "_append_tokens"),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    throughput.add_engine_args(parser, batch_sizes="16,64,256", max_num_seqs=256)
    throughput.add_load_format_arg(parser)
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size")
    parser.add_argument("--prefill-tokens", type=int, default=0,
                        help="time mixed steps: one prompt prefills this many tokens a step beside the decodes")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the timed steps (cProfile) and report the N functions with the most own time")
    parser.add_argument("--module-times", action="store_true",
                        help="also time the host time per step of each kind of model module (forward hooks)")
    parser.add_argument("--out", default="host_step.json")
    args = parser.parse_args(argv)
    args.batch_size_list = [int(b) for b in args.batch_sizes.split(",")]
    if min(args.batch_size_list + [args.steps]) < 1 or min(args.prefill_tokens, args.profile) < 0:
        parser.error("batch sizes and --steps must be positive, --prefill-tokens and --profile not negative")
    if max(args.batch_size_list) + (1 if args.prefill_tokens else 0) > args.max_num_seqs:
        parser.error("every batch size (and with --prefill-tokens, the prompt beside it) must fit in --max-num-seqs")
    if args.prefill_tokens * (args.steps + 2) + 2 > args.max_model_len:
        parser.error("--prefill-tokens times (--steps + 2) must fit in --max-model-len: the prompt outlasts the steps")
    return args


def _resolve(engine, path: str):
    target = engine
    for name in filter(None, path.split(".")):
        target = getattr(target, name)
    return target


def _timed(original, key: str, seconds: Counter, calls: Counter | None = None):
    """`original` wrapped so each call adds its wall time (and, with `calls`, one call) under `key`."""
    clock = time.perf_counter

    def timed(*args, **kwargs):
        started = clock()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[key] += clock() - started
            if calls is not None:
                calls[key] += 1

    return timed


class PartTimer:
    """Wraps the engine's methods named in PARTS so their wall time adds up per part; `restore` unwraps them."""

    def __init__(self, engine):
        self.seconds: Counter[str] = Counter()
        self._wrapped = []
        for part, path, method in PARTS:
            owner = _resolve(engine, path)
            original = getattr(owner, method)
            setattr(owner, method, self._timed(part, original))
            self._wrapped.append((owner, method))

    def _timed(self, part: str, original):
        return _timed(original, part, self.seconds)

    def restore(self) -> None:
        for owner, method in self._wrapped:
            delattr(owner, method)  # the instance attribute goes; the class's method shows again


class ModuleTimer:
    """Forward hooks on every module of the model whose class is not a container: the host time per class (a module
    nested in another counts in both), until `remove`. Token mixers run in parts (`project`, `mix`, `finish`), each
    timed as `<class>.<part>`."""

    def __init__(self, model):
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._started: dict[int, list[float]] = {}
        self._handles = []
        self._wrapped = []
        clock = time.perf_counter
        for module in model.modules():
            if module is model or type(module).__name__ in ("ModuleList", "ModuleDict", "Sequential"):
                continue
            name = type(module).__name__
            if hasattr(module, "mix"):
                for part in ("project", "mix", "finish"):
                    self._time_method(module, part, f"{name}.{part}")

            def before(module, inputs, key=id(module)):
                self._started.setdefault(key, []).append(clock())

            def after(module, inputs, output, key=id(module), name=name):
                self.seconds[name] += clock() - self._started[key].pop()
                self.calls[name] += 1

            self._handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def _time_method(self, module, part: str, key: str) -> None:
        setattr(module, part, _timed(getattr(module, part), key, self.seconds, self.calls))
        self._wrapped.append((module, part))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module, part in self._wrapped:
            delattr(module, part)  # the instance attribute goes; the class's method shows again


def measure(engine, batch: int, args) -> dict:
    from hybridkv.sidecar.core.sampling import SamplingParams

    vocab = engine.geometry.vocab_size
    requests = [f"decode-{batch}-{index}" for index in range(batch)]
    for request_id, prompt in zip(requests, throughput.random_prompts(batch, args.prompt_len, vocab,
                                                                       args.seed + batch)):
        engine.add_request(request_id, prompt, SamplingParams(
            temperature=0.0, max_tokens=args.steps + 8 + throughput.prefill_steps(engine, batch, args.prompt_len),
            ignore_eos=True))
    throughput.until_decoding(engine, requests)  # the batch's prompts at the full step budget
    if args.prefill_tokens:
        engine.scheduler.max_prefill_tokens_with_decodes = args.prefill_tokens
        prompt = throughput.random_prompts(1, args.prefill_tokens * (args.steps + 2), vocab, args.seed + 7)[0]
        engine.add_request("prefill", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        engine.step()  # admits it; every timed step then prefills its next chunk beside the decodes
    timer = PartTimer(engine)
    modules = ModuleTimer(engine.runner.model) if args.module_times else None
    kinds_before = dict(engine.steps_by_kind)
    profiler = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(args.steps):
        engine.step()
    if profiler is not None:
        profiler.disable()
    elapsed_s = time.perf_counter() - started
    timer.restore()
    if modules is not None:
        modules.remove()
    kinds = {kind: engine.steps_by_kind[kind] - kinds_before[kind] for kind in kinds_before}
    for request_id in requests + (["prefill"] if args.prefill_tokens else []):
        engine.abort(request_id)
    engine.scheduler.max_prefill_tokens_with_decodes = engine.scheduler.max_num_batched_tokens
    while engine.has_unfinished_requests():
        engine.step()
    per_step_ms = {part: 1000 * timer.seconds[part] / args.steps for part, _, _ in PARTS}  # parts, once each
    step_ms = 1000 * elapsed_s / args.steps
    per_step_ms["other"] = max(0.0, step_ms - sum(per_step_ms.values()))
    host_ms = sum(per_step_ms[part] for part in ("schedule", "batch", "outputs"))
    row = {"batch": batch, "prefill_tokens": args.prefill_tokens, "steps_by_kind": kinds, "step_ms": step_ms,
           "parts_ms": per_step_ms, "host_ms": host_ms, "host_us_per_request": 1000 * host_ms / batch}
    if profiler is not None:
        row["profile"] = top_functions(profiler, args.profile, args.steps)
    if modules is not None:
        row["module_host_ms"] = {name: {"ms_per_step": 1000 * seconds / args.steps,
                                        "calls_per_step": modules.calls[name] / args.steps}
                                 for name, seconds in modules.seconds.most_common()}
    return row


def top_functions(profiler: cProfile.Profile, count: int, steps: int) -> list[dict]:
    """The `count` functions with the most own (not cumulative) time, per step, with their calls per step; the
    profiler's own overhead inflates every figure alike, so they rank the costs rather than add up to the step."""
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, ...)}
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [{"function": f"{os.path.basename(path)}:{line}({name})", "calls_per_step": calls / steps,
             "own_ms_per_step": 1000 * own_s / steps, "cumulative_ms_per_step": 1000 * cumulative_s / steps}
            for (path, line, name), (_, calls, own_s, cumulative_s, _) in ranked]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.core.engine import Engine

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/host_step.py: no CUDA device is visible (use --device cpu --tiny on CPU)", file=sys.stderr)
        return 2
    folder = throughput.ensure_checkpoint(args)
    engine = Engine(EngineConfig(
        model=folder, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs + args.prefill_tokens),
        gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed, load_format=args.load_format,
        min_prefill_tokens_with_decodes=0,  # steps as scheduled, none held back (a serving policy)
    ))
    cuda_graphs = bool(engine.runner.graphs)
    try:
        rows = [measure(engine, batch, args) for batch in args.batch_size_list]
    finally:
        engine.close()
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    result = {"model": args.model, "tiny": args.tiny, "device": device_name, "steps": args.steps,
              "prefill_tokens": args.prefill_tokens,
              "cuda_graphs": cuda_graphs, "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    names = list(dict.fromkeys(part for part, _, _ in PARTS)) + ["other"]
    print(f"{'batch':>6} {'step ms':>8} " + " ".join(f"{name:>9}" for name in names)
          + f" {'host ms':>8} {'us/request':>10}")
    for row in rows:
        parts = " ".join(f"{row['parts_ms'][name]:>9.2f}" for name in names)
        print(f"{row['batch']:>6} {row['step_ms']:>8.2f} " + parts
              + f" {row['host_ms']:>8.2f} {row['host_us_per_request']:>10.1f}")
    for row in rows:
        if "module_host_ms" in row:
            print(f"\nbatch {row['batch']}: host time per step by kind of module (nested modules count in both)")
            print(f"{'ms':>8} {'calls':>7}  module")
            for name, entry in row["module_host_ms"].items():
                print(f"{entry['ms_per_step']:>8.3f} {entry['calls_per_step']:>7.1f}  {name}")
    for row in rows:
        if "profile" in row:
            print_profile(f"batch {row['batch']}: the functions with the most own host time, per step (under cProfile)",
                          row["profile"])
    return 0


def print_profile(title: str, entries: list[dict]) -> None:
    """`top_functions`' entries as a table under `title`."""
    print(f"\n{title}")
    print(f"{'own ms':>8} {'cum ms':>8} {'calls':>7}  function")
    for entry in entries:
        print(f"{entry['own_ms_per_step']:>8.3f} {entry['cumulative_ms_per_step']:>8.3f} "
              f"{entry['calls_per_step']:>7.1f}  {entry['function']}")


if __name__ == "__main__":
    throughput.run_script(main)
