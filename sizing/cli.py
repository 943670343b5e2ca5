"""`hybridkv plan` and `hybridkv simulate`.

Both take a HybridModel YAML file (default: the bundled Qwen3.5-4B on one H200) or flags; flags are written into the
resource before it is validated, so a file and flags go through the same parser. Torch-free.
"""

from __future__ import annotations

import argparse
import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.errors import UserError
from hybridkv.sizing.errors import PlanError
from hybridkv.sizing.geometry import read_config_file
from hybridkv.sizing.gpus import GpuSpec, gpu_spec
from hybridkv.sizing.planner import DEFAULT_RESERVE_MARGIN, Plan, plan
from hybridkv.sizing.prediction import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hybridkv.sizing.report import render_plan, render_table
from hybridkv.sizing.spec import API_VERSION, KIND, parse_hybridmodel, read_hybridmodel_file

DEFAULT_SPEC = "qwen3.5-4b-h200.yaml"


def default_spec_path() -> Path:
    """The bundled example HybridModel (also examples/qwen3.5-4b-h200.yaml)."""
    return Path(str(resources.files("hybridkv.sizing").joinpath("data", DEFAULT_SPEC)))


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", help=f"HybridModel YAML file (default: the bundled {DEFAULT_SPEC})")
    parser.add_argument("--model", help="catalog name or Hugging Face id (replaces spec.model.name)")
    parser.add_argument("--model-config", metavar="FILE", help="the model's config.json (models not in the catalog)")
    parser.add_argument("--gpu", help="GPU name or GFD product, e.g. h200 or NVIDIA-H200 (replaces spec.gpu)")
    parser.add_argument("--gpu-memory-mib", type=int, help="GPU memory in MiB, for a GPU not in the catalog")
    parser.add_argument("--max-model-len", type=int, help="longest request in tokens (serving.maxModelLen)")
    parser.add_argument("--max-concurrency", type=int, help="running requests per replica (serving.maxConcurrency)")
    parser.add_argument("--target-tokens", type=int, help="attention-KV tokens per replica (serving.targetTokens)")
    parser.add_argument("--max-gpus", type=int, help="most GPUs per replica (gpu.maxPerReplica)")
    parser.add_argument("--tp", type=int, help="fix the tensor-parallel size (overrides.tensorParallelSize)")
    parser.add_argument("--gpu-memory-utilization", help='fix the utilization, e.g. 0.90 (overrides)')
    parser.add_argument("--max-num-seqs", type=int, help="fix max_num_seqs (overrides.maxNumSeqs)")
    parser.add_argument("--kv-cache-memory", type=int, metavar="BYTES", help="fix the cache budget per rank in bytes")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help="tokens per engine step, for the activation reserve (default %(default)s)")
    parser.add_argument("--reserve-margin", default=str(DEFAULT_RESERVE_MARGIN),
                        help="the target must hold if the reserve is (1 + this) × the estimate (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def register(subparsers: Any) -> None:
    plan_parser = subparsers.add_parser(
        "plan",
        help="plan GPUs, utilization and pools for a HybridModel",
        description="Choose the fewest GPUs and the lowest gpu_memory_utilization that hold the target, and show "
        "the dual pool next to vLLM 0.20 (none mode), vLLM 0.33 (align mode) and the ideal bound on the same memory.",
    )
    _add_model_flags(plan_parser)
    plan_parser.set_defaults(handler=plan_command)

    simulate_parser = subparsers.add_parser(
        "simulate",
        help="replay a workload through each allocator on the planned memory",
        description="Plan as `hybridkv plan` does, then replay a workload (a JSONL trace or a seeded synthetic one) "
        "through the admission rules of each allocator on the same budget.",
    )
    _add_model_flags(simulate_parser)
    workload = simulate_parser.add_argument_group("workload")
    workload.add_argument("--trace", metavar="FILE", help="JSONL trace: arrival_step, prompt_tokens, output_tokens")
    workload.add_argument("--requests", type=int, default=2000, help="synthetic requests (default %(default)s)")
    workload.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default %(default)s)")
    workload.add_argument("--arrivals-per-step", type=float, default=8.0, help="mean arrivals per step")
    workload.add_argument("--mean-prompt-tokens", type=int, default=1024)
    workload.add_argument("--mean-output-tokens", type=int, default=256)
    workload.add_argument("--write-trace", metavar="FILE", help="write the workload as a JSONL trace")
    simulate_parser.set_defaults(handler=simulate_command)


def _resource_from_args(args: argparse.Namespace) -> tuple[dict, bool]:
    """The HybridModel object the flags describe, and whether it must name a weight source (only from a file)."""
    if args.spec or not args.model:
        obj = read_hybridmodel_file(args.spec or default_spec_path())
        if not isinstance(obj, dict):
            return obj, True
        obj = copy.deepcopy(obj)
        from_file = True
    else:
        obj = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "cli"}, "spec": {"serving": {}}}
        from_file = False
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return obj, from_file
    if args.model:
        spec["model"] = {"name": args.model}
        from_file = False
    serving = spec.setdefault("serving", {})
    gpu = spec.get("gpu") if isinstance(spec.get("gpu"), dict) else {}
    overrides = spec.get("overrides") if isinstance(spec.get("overrides"), dict) else {}
    if args.gpu or args.gpu_memory_mib is not None:
        gpu = {k: v for k, v in gpu.items() if k == "maxPerReplica"}
    updates = [
        (serving, "maxModelLen", args.max_model_len),
        (serving, "maxConcurrency", args.max_concurrency),
        (serving, "targetTokens", args.target_tokens),
        (gpu, "product", args.gpu),
        (gpu, "memoryMiB", args.gpu_memory_mib),
        (gpu, "maxPerReplica", args.max_gpus),
        (overrides, "tensorParallelSize", args.tp),
        (overrides, "gpuMemoryUtilization", args.gpu_memory_utilization),
        (overrides, "maxNumSeqs", args.max_num_seqs),
    ]
    for section, key, value in updates:
        if value is not None:
            section[key] = value
    if gpu:
        spec["gpu"] = gpu
    if overrides:
        spec["overrides"] = overrides
    return obj, from_file


def plan_from_args(args: argparse.Namespace) -> Plan:
    obj, from_file = _resource_from_args(args)
    spec = parse_hybridmodel(obj, require_source=from_file)
    gpu: GpuSpec | None = None
    if args.gpu and args.gpu_memory_mib is None:
        gpu = gpu_spec(args.gpu)
    model_config = read_config_file(args.model_config) if args.model_config else None
    if spec.model.config is None and model_config is None and spec.model.config_map_ref is not None:
        raise PlanError("this HybridModel reads its config from a ConfigMap; pass the config.json with --model-config")
    return plan(
        spec,
        gpu,
        model_config=model_config,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        reserve_margin=args.reserve_margin,
    )


def plan_command(args: argparse.Namespace) -> int:
    result = plan_from_args(args)
    print(json.dumps(result.to_dict(), indent=2) if args.json else render_plan(result))
    return 0


def simulate_command(args: argparse.Namespace) -> int:
    from hybridkv.sizing.simulate import read_trace, replay_all, synthetic_workload, write_trace

    result = plan_from_args(args)
    if args.trace:
        requests = read_trace(args.trace)
        source = f"trace {args.trace} ({len(requests)} requests)"
    else:
        requests = synthetic_workload(
            args.seed, args.requests, result.max_model_len, args.arrivals_per_step, args.mean_prompt_tokens,
            args.mean_output_tokens,
        )
        source = (
            f"synthetic workload: {args.requests} requests, seed {args.seed}, {args.arrivals_per_step} arrivals "
            f"per step, mean prompt {args.mean_prompt_tokens} / output {args.mean_output_tokens} tokens"
        )
    if args.write_trace:
        try:
            write_trace(requests, args.write_trace)
        except OSError as exc:
            raise UserError(f"--write-trace: cannot write {args.write_trace!r}: {exc.strerror}; pass a path in an "
                            "existing, writable folder") from None
    results = replay_all(result.allocators, requests, result.max_model_len)
    if args.json:
        print(json.dumps({
            "plan": result.to_dict(),
            "workload": source,
            "results": {key: value.to_dict() for key, value in results.items()},
        }, indent=2))
        return 0
    print(render_plan(result))
    print()
    print(f"replay of the {source} on {result.prediction.budget_bytes / 2**30:,.2f} GiB per rank, "
          f"max_num_seqs {result.max_num_seqs}")
    header = ["allocator", "steps", "completed", "refused", "preempted", "peak running", "mean running",
              "peak tokens held", "mean queue steps"]
    rows = [[r.label, f"{r.steps:,}", f"{r.completed:,}", f"{r.refused:,}", f"{r.preemptions:,}",
             f"{r.peak_concurrency:,}", f"{r.mean_concurrency:,.1f}", f"{r.peak_tokens_held:,}",
             f"{r.mean_queue_steps:,.1f}"] for r in results.values()]
    print("\n".join("  " + line for line in render_table(header, rows)))
    return 0
