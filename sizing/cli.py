"""`hybridkv plan` and `hybridkv simulate`.

Both take a HybridModel YAML file (default: the bundled Qwen3.5-4B on one H200) or flags; flags are written into the
resource before it is validated, so a file and flags go through the same parser. Torch-free.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.errors import UserError
from hybridkv.sizing.allocators import DEFAULT_VLLM_CUDA_MAJOR
from hybridkv.sizing.errors import PlanError, SpecError
from hybridkv.sizing.geometry import read_config_file
from hybridkv.sizing.gpus import GpuSpec, gpu_spec
from hybridkv.sizing.prefix import DEFAULT_CHECKPOINT_INTERVAL_TOKENS
from hybridkv.sizing.planner import DEFAULT_RESERVE_MARGIN, Plan, plan
from hybridkv.sizing.prediction import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hybridkv.sizing.quantities import parse_bytes
from hybridkv.sizing.report import render_plan, render_table
from hybridkv.sizing.memory import KV_CACHE_DTYPES
from hybridkv.sizing.spec import (
    API_VERSION,
    CONVERSATION_HISTORIES,
    KIND,
    SSM_STATE_DTYPES,
    parse_hybridmodel,
    read_hybridmodel_file,
)

DEFAULT_SPEC = "qwen3.5-4b-h200.yaml"
PREFIX_WORKLOADS = ("multi-turn", "multi-turn-rerendered", "shared-document")
# hybridkv simulate's synthetic workload when no flag sizes it.
SYNTHETIC_REQUESTS = 2000
SYNTHETIC_MEAN_PROMPT_TOKENS = 1024
SYNTHETIC_MEAN_OUTPUT_TOKENS = 256


def default_spec_path() -> Path:
    """The bundled example HybridModel (also examples/qwen3.5-4b-h200.yaml)."""
    return Path(str(resources.files("hybridkv.sizing").joinpath("data", DEFAULT_SPEC)))


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", help=f"HybridModel YAML file (default: the bundled {DEFAULT_SPEC})")
    parser.add_argument("--model", help="catalog name or Hugging Face id (replaces spec.model.name)")
    parser.add_argument("--model-config", metavar="FILE", help="the model's config.json (models not in the catalog)")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="a checkpoint folder: its config.json (unless --model-config) and the exact weight bytes "
                             "of its safetensors headers")
    parser.add_argument("--gpu", help="GPU name or GFD product, e.g. h200 or NVIDIA-H200 (replaces spec.gpu)")
    parser.add_argument("--gpu-memory-mib", type=int, help="GPU memory in MiB, for a GPU not in the catalog")
    parser.add_argument("--max-model-len", type=int, help="longest request in tokens (serving.maxModelLen)")
    parser.add_argument("--max-concurrency", type=int, help="running requests per replica (serving.maxConcurrency)")
    parser.add_argument("--target-tokens", type=int, help="attention-KV tokens per replica (serving.targetTokens)")
    parser.add_argument("--guarantee-full-length", action="store_true",
                        help="hold every running request at max-model-len at once (serving.guaranteeFullLength)")
    parser.add_argument("--ssm-dtype", choices=SSM_STATE_DTYPES,
                        help="GDN recurrent state dtype (serving.ssmStateDtype; default: the model config's)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        help="attention KV pool dtype (serving.kvCacheDtype): auto is the model dtype, fp8 is e4m3 "
                             "with static per-layer scales")
    parser.add_argument("--mean-prompt-tokens", type=int, help="workload: mean prompt length (serving.workload)")
    parser.add_argument("--mean-output-tokens", type=int, help="workload: mean output length (serving.workload)")
    parser.add_argument("--p90-prompt-tokens", type=int, help="workload: 90th-percentile prompt length")
    parser.add_argument("--p90-output-tokens", type=int, help="workload: 90th-percentile output length")
    parser.add_argument("--workload-trace", metavar="FILE",
                        help="workload: size from this JSONL trace (hybridkv simulate's format)")
    parser.add_argument("--max-preemption-rate", metavar="RATE",
                        help='workload: preemptions per request allowed, e.g. "0.01" (the default)')
    parser.add_argument("--conversation-turns", type=int, metavar="N",
                        help="workload: the requests are the turns of chats of up to N turns, the prompt and output "
                             "lengths each turn's message and reply (serving.workload.conversations)")
    parser.add_argument("--system-prompt-tokens", type=int, metavar="N",
                        help="workload: the chats' shared system prompt (with --conversation-turns)")
    parser.add_argument("--conversation-history", choices=CONVERSATION_HISTORIES,
                        help="workload: how the chats' clients send the history back: messages the server renders "
                             "again (the chat endpoint; the default) or the token ids it produced")
    parser.add_argument("--max-gpus", type=int, help="most GPUs per replica (gpu.maxPerReplica)")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="the GPU is shared (MIG, time-slicing): take the lowest utilization that fits (gpu.shared)")
    parser.add_argument("--compute-capability", metavar="M.N",
                        help="GPU compute capability, for a GPU known only by memory (gpu.computeCapability)")
    parser.add_argument("--tp", type=int, help="fix the tensor-parallel size (overrides.tensorParallelSize)")
    parser.add_argument("--gpu-memory-utilization", help='fix the utilization, e.g. 0.90 (overrides)')
    parser.add_argument("--max-num-seqs", type=int, help="fix max_num_seqs (overrides.maxNumSeqs)")
    parser.add_argument("--kv-cache-memory", metavar="BYTES",
                        help="fix the cache budget per rank: bytes, or a quantity such as 8Gi")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help="tokens per engine step, for the activation reserve (default %(default)s)")
    parser.add_argument("--reserve-margin", default=str(DEFAULT_RESERVE_MARGIN),
                        help="the target must hold if the reserve is (1 + this) × the estimate (default %(default)s)")
    parser.add_argument("--vllm-cuda", type=int, default=DEFAULT_VLLM_CUDA_MAJOR, choices=(12, 13),
                        help="CUDA major of the vLLM build the vLLM columns describe (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


PLAN_DESCRIPTION = """\
Choose the fewest GPUs that hold what the HybridModel asks for, and show the dual pool next to vLLM 0.20 (none mode),
vLLM 0.33 (align mode, by GPU architecture, with the start-up log vLLM would print) and the ideal bound.

What must fit: --target-tokens; or --guarantee-full-length (every request at max-model-len at once); or a workload
(--mean-prompt-tokens/--mean-output-tokens, or --workload-trace) replayed at max-concurrency within
--max-preemption-rate; by default what vLLM itself requires: max-concurrency state slots and one request at
max-model-len. The plan says what that holds and shows the full-length guarantee as an alternative.
--conversation-turns and --system-prompt-tokens make the workload chats (the lengths then those of each turn's
message and reply); with prefix caching (on unless --no-prefix-caching) their replay also sizes the checkpoint pool.

Utilization: whole GPUs get the highest utilization that leaves the reserve's safety margin free (at most 0.95);
--shared-gpu takes the lowest that fits; --gpu-memory-utilization fixes it."""


def register(subparsers: Any) -> None:
    plan_parser = subparsers.add_parser(
        "plan",
        help="plan GPUs, utilization and pools for a HybridModel",
        description=PLAN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_flags(plan_parser)
    _add_prefix_flags(plan_parser.add_argument_group("prefix caching"),
                      "size the dual pool with GDN state checkpoints for prefix caching, as `hybridkv serve` runs "
                      "by default (serving.prefixCaching.enabled; default on); --no-prefix-caching plans without",
                      argparse.BooleanOptionalAction, None)
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
    workload.add_argument("--requests", type=int, help=f"synthetic requests (default {SYNTHETIC_REQUESTS})")
    workload.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default %(default)s)")
    workload.add_argument("--arrivals-per-step", type=float, default=8.0, help="mean arrivals per step")
    workload.add_argument("--write-trace", metavar="FILE", help="write the workload as a JSONL trace")
    prefix = simulate_parser.add_argument_group("prefix caching")
    _add_prefix_flags(prefix, "plan with checkpoints and replay with each allocator's prefix cache; --trace then "
                              "gives prompt_ids and output_ids (without it both plan and replay have no prefix "
                              "cache)", "store_true", False)
    prefix.add_argument("--prefix-workload", choices=PREFIX_WORKLOADS,
                        help="synthetic workload with shared prefixes when no --trace (default: the chats of "
                             "serving.workload.conversations when the spec or flags describe them, else multi-turn): "
                             "64 chats of 4 turns on a 2048-token system prompt (rerendered: each turn sends the "
                             "history as a chat template renders it again, not the generated ids), or questions on "
                             "8 4096-token documents")
    simulate_parser.set_defaults(handler=simulate_command)


def _add_prefix_flags(group: Any, what: str, action: Any, default: bool | None) -> None:
    group.add_argument("--prefix-caching", action=action, default=default, help=what)
    group.add_argument("--prefix-checkpoint-slots", type=int, metavar="N",
                       help="dual pool checkpoint slots (serving.prefixCaching.checkpointSlots; default: half "
                            "of max_num_seqs)")
    group.add_argument("--prefix-checkpoint-interval", type=int, metavar="TOKENS",
                       help="also checkpoint long prompts every TOKENS tokens, a multiple of 16; 0: prompt ends "
                            "only (serving.prefixCaching.checkpointIntervalTokens; default "
                            f"{DEFAULT_CHECKPOINT_INTERVAL_TOKENS})")


def _check_flag_conflicts(args: argparse.Namespace) -> None:
    """Flags that contradict each other are an error, never resolved silently."""
    if args.gpu and args.gpu_memory_mib is not None:
        raise SpecError("--gpu and --gpu-memory-mib both name the GPU; give one (--gpu-memory-mib for a GPU the "
                        "catalog does not know)")
    if args.tp is not None and args.max_gpus is not None and args.tp > args.max_gpus:
        raise SpecError(f"--tp {args.tp} needs {args.tp} GPUs but --max-gpus allows {args.max_gpus}; drop one")
    distribution = [flag for flag, value in (
        ("--mean-prompt-tokens", args.mean_prompt_tokens), ("--mean-output-tokens", args.mean_output_tokens),
        ("--p90-prompt-tokens", args.p90_prompt_tokens), ("--p90-output-tokens", args.p90_output_tokens),
    ) if value is not None]
    if args.workload_trace and distribution:
        raise SpecError(f"--workload-trace gives the request lengths; {', '.join(distribution)} cannot be used with it")
    trace = getattr(args, "trace", None)
    if trace and getattr(args, "requests", None) is not None:
        raise SpecError("--trace replays its own requests; --requests sizes a synthetic workload: give one")


def _workload_from_args(args: argparse.Namespace) -> dict | None:
    chat = [flag for flag, value in (("--conversation-turns", args.conversation_turns),
                                     ("--system-prompt-tokens", args.system_prompt_tokens),
                                     ("--conversation-history", args.conversation_history)) if value is not None]
    if chat and (args.conversation_turns is None or args.system_prompt_tokens is None):
        raise SpecError("chats need both --conversation-turns and --system-prompt-tokens")
    if chat and (args.workload_trace or args.mean_prompt_tokens is None or args.mean_output_tokens is None):
        raise SpecError(f"{', '.join(chat)} describe chats whose turns have the lengths of --mean-prompt-tokens and "
                        "--mean-output-tokens; give those (not --workload-trace)")
    if args.workload_trace:
        return {"traceConfigMapRef": {"name": "workload-trace"}}
    if args.mean_prompt_tokens is None and args.mean_output_tokens is None:
        for flag, value in (("--p90-prompt-tokens", args.p90_prompt_tokens),
                            ("--p90-output-tokens", args.p90_output_tokens)):
            if value is not None:
                raise SpecError(f"{flag} needs --mean-prompt-tokens and --mean-output-tokens beside it")
        return None
    if args.mean_prompt_tokens is None or args.mean_output_tokens is None:
        raise SpecError("a workload needs both --mean-prompt-tokens and --mean-output-tokens")
    workload = {}
    for key, mean, p90 in (("promptTokens", args.mean_prompt_tokens, args.p90_prompt_tokens),
                           ("outputTokens", args.mean_output_tokens, args.p90_output_tokens)):
        workload[key] = {"mean": mean, **({"p90": p90} if p90 is not None else {})}
    if args.conversation_turns is not None:
        workload["conversations"] = {"systemPromptTokens": args.system_prompt_tokens,
                                     "turns": args.conversation_turns,
                                     **({"history": args.conversation_history} if args.conversation_history else {})}
    return workload


def _resource_from_args(args: argparse.Namespace) -> tuple[dict, bool]:
    """The HybridModel object the flags describe, and whether it must name a weight source (only from a file)."""
    _check_flag_conflicts(args)
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
    if not isinstance(serving, dict):
        return obj, from_file
    gpu = spec.get("gpu") if isinstance(spec.get("gpu"), dict) else {}
    overrides = spec.get("overrides") if isinstance(spec.get("overrides"), dict) else {}
    if args.gpu or args.gpu_memory_mib is not None:
        gpu = {k: v for k, v in gpu.items() if k in ("maxPerReplica", "shared")}
    workload = _workload_from_args(args)
    if workload is not None:
        serving["workload"] = workload
    if args.max_preemption_rate is not None:
        if not isinstance(serving.get("workload"), dict):
            raise SpecError("--max-preemption-rate applies to a workload; give --mean-prompt-tokens and "
                            "--mean-output-tokens or --workload-trace")
        serving["workload"]["maxPreemptionRate"] = args.max_preemption_rate
    updates = [
        (serving, "maxModelLen", args.max_model_len),
        (serving, "maxConcurrency", args.max_concurrency),
        (serving, "targetTokens", args.target_tokens),
        (serving, "guaranteeFullLength", True if args.guarantee_full_length else None),
        (serving, "ssmStateDtype", args.ssm_dtype),
        (serving, "kvCacheDtype", args.kv_cache_dtype),
        (gpu, "product", args.gpu),
        (gpu, "memoryMiB", args.gpu_memory_mib),
        (gpu, "maxPerReplica", args.max_gpus),
        (gpu, "shared", True if args.shared_gpu else None),
        (gpu, "computeCapability", args.compute_capability),
        (overrides, "tensorParallelSize", args.tp),
        (overrides, "gpuMemoryUtilization", args.gpu_memory_utilization),
        (overrides, "maxNumSeqs", args.max_num_seqs),
    ]
    for section, key, value in updates:
        if value is not None:
            section[key] = value
    prefix = {key: value for key, value in (
        ("enabled", args.prefix_caching),  # None (plan without the flag): the spec's, on by default
        ("checkpointSlots", args.prefix_checkpoint_slots),
        ("checkpointIntervalTokens", args.prefix_checkpoint_interval),
    ) if value is not None}
    if args.prefix_caching is False:  # off whatever the file says (checkpoint flags given with it are an error)
        serving["prefixCaching"] = {}
    if prefix:
        if not isinstance(serving.get("prefixCaching"), dict):
            serving["prefixCaching"] = {}
        serving["prefixCaching"].update(prefix)
    if gpu:
        spec["gpu"] = gpu
    if overrides:
        spec["overrides"] = overrides
    return obj, from_file


def _spec_from_args(args: argparse.Namespace):
    obj, from_file = _resource_from_args(args)
    return parse_hybridmodel(obj, require_source=from_file)


def plan_from_args(args: argparse.Namespace, spec=None) -> Plan:
    """The plan for the flags (and the HybridModel they name, `spec` when the caller has parsed it already)."""
    from hybridkv.sizing.simulate import read_trace

    spec = spec or _spec_from_args(args)
    gpu: GpuSpec | None = None
    if args.gpu and args.gpu_memory_mib is None:
        gpu = gpu_spec(args.gpu)
    config_file = args.model_config
    if args.checkpoint is not None:
        if not os.path.isdir(args.checkpoint):
            raise PlanError(f"--checkpoint {args.checkpoint!r} is not a folder")
        if config_file is None:
            config_file = os.path.join(args.checkpoint, "config.json")
    if args.model_config and spec.model.config is not None:
        raise PlanError("the HybridModel carries its config inline (spec.model.config) and --model-config gives "
                        "another: give one")
    model_config = read_config_file(config_file) if config_file else None
    if spec.model.config is None and model_config is None and spec.model.config_map_ref is not None:
        raise PlanError("this HybridModel reads its config from a ConfigMap; pass the config.json with --model-config")
    workload = spec.serving.workload
    if workload is not None and workload.trace_config_map_ref is not None and not args.workload_trace:
        raise PlanError("this HybridModel reads its workload trace from a ConfigMap; pass it with --workload-trace")
    return plan(
        spec,
        gpu,
        model_config=model_config,
        workload_trace=read_trace(args.workload_trace) if args.workload_trace else None,
        kv_cache_memory_bytes=None if args.kv_cache_memory is None else parse_bytes(args.kv_cache_memory),
        max_num_batched_tokens=args.max_num_batched_tokens,
        reserve_margin=args.reserve_margin,
        vllm_cuda_major=args.vllm_cuda,
        checkpoint_folder=args.checkpoint,
    )


def plan_command(args: argparse.Namespace) -> int:
    result = plan_from_args(args)
    print(json.dumps(result.to_dict(), indent=2) if args.json else render_plan(result))
    return 0


def simulate_command(args: argparse.Namespace) -> int:
    from hybridkv.sizing.simulate import read_trace, replay_all, synthetic_workload, write_trace

    spec = _spec_from_args(args)
    result = plan_from_args(args, spec)
    if args.prefix_caching:
        return _simulate_prefix(args, result, spec.serving)
    if args.trace:
        requests = read_trace(args.trace)
        source = f"trace {args.trace} ({len(requests)} requests)"
    else:
        count = SYNTHETIC_REQUESTS if args.requests is None else args.requests
        prompt = args.mean_prompt_tokens or SYNTHETIC_MEAN_PROMPT_TOKENS
        output = args.mean_output_tokens or SYNTHETIC_MEAN_OUTPUT_TOKENS
        requests = synthetic_workload(args.seed, count, result.max_model_len, args.arrivals_per_step, prompt, output)
        source = (
            f"synthetic workload: {count} requests, seed {args.seed}, {args.arrivals_per_step} arrivals "
            f"per step, mean prompt {prompt} / output {output} tokens"
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


def _simulate_prefix(args: argparse.Namespace, result: Plan, serving) -> int:
    from hybridkv.sizing.workload import conversation_requests, describe_workload
    from hybridkv.sizing.prefix import (
        multi_turn_workload,
        prefix_cache_models,
        read_token_trace,
        replay_prefix_all,
        shared_document_workload,
        write_token_trace,
    )

    slots, interval = result.layout.checkpoint_slots, result.checkpoint_interval_tokens
    workload = serving.workload
    if args.trace:
        requests = read_token_trace(args.trace)
        source = f"trace {args.trace} ({len(requests)} requests)"
    elif args.prefix_workload is None and workload is not None and workload.conversations is not None:
        # The chats the planner sized the checkpoint pool from (seed 0), all of them.
        requests = conversation_requests(workload, result.max_model_len, serving.max_concurrency, args.seed)
        source = (f"serving.workload's {serving.max_concurrency} chats, seed {args.seed}: "
                  f"{describe_workload(workload, requests)}")
    elif args.prefix_workload in (None, "multi-turn", "multi-turn-rerendered"):
        name = args.prefix_workload or "multi-turn"
        requests = multi_turn_workload(args.seed, rerendered=name == "multi-turn-rerendered")
        source = f"{name} workload, seed {args.seed} ({len(requests)} requests)"
    else:
        requests = shared_document_workload(args.seed)
        source = f"shared-document workload, seed {args.seed} ({len(requests)} requests)"
    if args.write_trace:
        try:
            write_token_trace(requests, args.write_trace)
        except OSError as exc:
            raise UserError(f"--write-trace: cannot write {args.write_trace!r}: {exc.strerror}; pass a path in an "
                            "existing, writable folder") from None
    models = prefix_cache_models(result.allocators, result.prediction.rank_bytes, slots, interval)
    results = replay_prefix_all(models, requests, result.max_model_len)
    if args.json:
        print(json.dumps({"plan": result.to_dict(), "workload": source,
                          "results": {key: value.to_dict() for key, value in results.items()}}, indent=2))
        return 0
    print(render_plan(result))
    print()
    print(f"prefix-caching replay of the {source}, max_num_seqs {result.max_num_seqs}, {slots} checkpoint slots")
    print("\n".join("  " + line for line in render_table(*prefix_table(results))))
    refused = max(r.refused for r in results.values())
    if refused:
        print(f"  {refused:,} of {len(requests):,} requests were refused on arrival (longer than max_model_len "
              f"{result.max_model_len:,} or than the whole pool) and are in no figure above")
    return 0


def prefix_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the prefix-caching comparison (also docs/capacity.md's table)."""
    header = ["allocator", "block", "hit tokens", "of unbounded", "hits by checkpoint kind", "cached blocks",
              "checkpoints", "preempted", "steps"]
    rows = []
    for r in results.values():
        kinds = ", ".join(f"{kind} {tokens:,}" for kind, tokens in sorted(r.hit_tokens_by_kind.items())) or "-"
        rows.append([r.label, f"{r.cache_block_tokens}", f"{r.hit_fraction:.1%}",
                     f"{r.unbounded_fraction:.1%}" if r.unbounded_fraction is not None else "-", kinds,
                     f"{r.peak_cached_block_bytes / 2**30:,.2f} GiB", f"{r.peak_checkpoint_bytes / 2**30:,.2f} GiB",
                     f"{r.preemptions:,}", f"{r.steps:,}"])
    return header, rows
