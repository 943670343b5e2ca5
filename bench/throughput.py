"""Engine throughput against Hugging Face transformers on the same random checkpoint, in one run.

For each batch size: B requests of `--prompt-len` random tokens, `--new-tokens` greedy tokens each (eos ignored).
Prefill tokens/s = B x prompt / time until every request has its first token; decode tokens/s = tokens generated after
that point / time from then to the last token; every prompt of a batch is admitted as soon as it fits (no prefill held
back for a fuller mixed step, which is a serving policy: bench/serving.py measures it). Transformers `generate` runs the
same prompts at the same batch sizes (with fla's kernels when fla is installed, the stronger baseline; --hf-without-fla
forces its plain-torch GDN path). Also reports the engine's measured capacity against the planner's prediction for the
same settings, and each decode rate against the memory-bandwidth roofline (weights + recurrent state read and written +
attention KV read, per step): at --bandwidth-tbs (the figure the targets are set against), and on a GPU also at the
device-to-device copy rate measured at the start of the same run (`kernel_speed.ceilings`, before the engine takes
the memory), so a rate is read against what this GPU's memory does rather than an assumed figure.

    python bench/throughput.py --out throughput.json          # Qwen3.5-4B geometry, bf16, on the GPU
    python bench/throughput.py --tensor-parallel-size 2 --hf-batch-sizes=   # the engine on two GPUs, no baseline
    python bench/throughput.py --model qwen3.5-35b-a3b --load-format random  # weights built in GPU memory

With --tensor-parallel-size above 1, each batch size also runs --collective-steps decode steps under the torch profiler
on rank 0 (after its timed run, on the same prompts): the time of the collectives (NCCL kernels on a GPU, including
those CUDA graphs replay; the c10d ops on CPU) per step and as a share of the step's wall time.

For MoE models the roofline counts the weights a step reads: every dense weight, and of each MoE layer the experts
the batch is expected to touch (E * (1 - (1 - k/E)^B) of E with uniform routing, which random weights give).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_args(parser, batch_sizes="1,16,64,256", max_num_seqs=256)
    parser.add_argument("--hf-batch-sizes", default="1,16,64", help="transformers is slow: fewer sizes by default")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks of the engine, one GPU each (transformers runs on one GPU regardless)")
    parser.add_argument("--hf-without-fla", action="store_true", help="hide fla from transformers")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.3, help="device copy bandwidth for the roofline")
    add_load_format_arg(parser)
    parser.add_argument("--collective-steps", type=int, default=16,
                        help="decode steps profiled per batch size for the collectives' share (tp > 1; 0: none)")
    parser.add_argument("--out", default="throughput.json", help="where to write the results (JSON)")
    args = parser.parse_args(argv)
    if args.quantize and args.hf_batch_sizes:
        parser.error("--quantize: the transformers baseline runs 16-bit weights only; pass --hf-batch-sizes= and "
                     "compare with a run without --quantize")
    return args


class _LoadFormat(argparse.Action):
    """Stores --load-format with vLLM's alias `dummy` read as `random`."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, "random" if value == "dummy" else value)


def add_load_format_arg(parser) -> None:
    """--load-format, shared with the benches that start one engine of this tree (bench/revisions.py does not: the
    revisions it times may predate the flag)."""
    parser.add_argument("--load-format", choices=("safetensors", "random", "dummy"), default="safetensors",
                        action=_LoadFormat,
                        help="random (alias dummy): build the random weights directly in GPU memory (each rank its "
                        "shard), the same for the engine and transformers, instead of writing and reading a checkpoint")


def add_engine_args(parser, batch_sizes: str, max_num_seqs: int) -> None:
    """Checkpoint, workload and engine settings, shared with bench/revisions.py so both time the same thing."""
    parser.add_argument("--model", default="qwen3.5-4b", help="catalog geometry of the random checkpoint")
    parser.add_argument("--checkpoint", help="checkpoint folder (random weights are written there if it has none; "
                        "default: $TMPDIR/hybridkv-<model>-bf16, shared with the GPU tests)")
    parser.add_argument("--batch-sizes", default=batch_sizes)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of this script with --tiny")
    parser.add_argument("--tiny", action="store_true", help="a few-MB scaled-down model (smoke runs, not figures)")
    parser.add_argument("--quantize", choices=("fp8", "awq", "w4a16"),
                        help="store the projections in this published format (make-model --quantize); the engine's "
                        "roofline counts the stored bytes (transformers runs only on 16-bit weights)")


def ensure_checkpoint(args) -> str:
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    quantize = getattr(args, "quantize", None)  # bench/tp_capacity.py has neither flag
    if getattr(args, "load_format", "safetensors") == "random":  # config and tokenizer only: the weights are built on device
        folder = args.checkpoint or tempfile.mkdtemp(prefix=f"hybridkv-{args.model}-config-")
        make_model(folder, catalog_geometry(args.model), seed=args.seed, dtype="bfloat16", tiny=args.tiny,
                   quantize=quantize, weights=False)
        return folder
    folder = args.checkpoint or os.path.join(tempfile.gettempdir(),
                                             f"hybridkv-{args.model}{'-tiny' if args.tiny else ''}-"
                                             f"{quantize or 'bf16'}")
    # make_model writes generation_config.json last: its presence means a complete checkpoint.
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        started = time.perf_counter()
        make_model(folder, catalog_geometry(args.model), seed=args.seed, dtype="bfloat16", tiny=args.tiny,
                   quantize=quantize)
        print(f"wrote random {quantize or 'bf16'} {args.model} checkpoint to {folder} in "
              f"{time.perf_counter() - started:.0f} s")
    return folder


def prefill_steps(engine, batch: int, prompt_len: int) -> int:
    """An upper bound on the steps `batch` prompts of `prompt_len` tokens take to prefill at the engine's step budget
    (each step also runs the decodes of those already through)."""
    per_step = max(1, engine.scheduler.max_num_batched_tokens - batch)
    return -(-batch * prompt_len // per_step) + 1


def until_decoding(engine, request_ids) -> None:
    """Step the engine until every one of `request_ids` is running and past its prompt (added requests wait in the
    engine's inbox until a step takes them in, so the scheduler's queues alone do not say so)."""
    wanted = set(request_ids)
    while True:
        running = [seq for seq in engine.scheduler.running if seq.request_id in wanted]
        if len(running) == len(wanted) and all(seq.num_uncomputed_tokens == 1 for seq in running):
            return
        if not engine.has_unfinished_requests():
            raise RuntimeError("the requests finished before they all decoded: raise their max_tokens")
        engine.step()


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=generator).tolist()


def run_engine(engine, prompts, new_tokens: int) -> dict:
    # The engine module's own class: an engine from another revision tree (bench/revisions.py) checks for it.
    SamplingParams = sys.modules[type(engine).__module__].SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"bench-{len(prompts)}-{index}", prompt, params)
    started = time.perf_counter()
    first_token_at = None
    decode_wait_started = None
    started_requests: set[str] = set()
    steps = decode_steps = decode_tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        if first_token_at is not None:
            decode_steps += 1
            decode_tokens += sum(len(o.new_token_ids) for o in outputs)
        started_requests.update(o.request_id for o in outputs if o.completion_tokens >= 1)
        if first_token_at is None and len(started_requests) == len(prompts):
            first_token_at = time.perf_counter()
            decode_wait_started = _device_wait_s(engine)
    finished = time.perf_counter()
    batch = len(prompts)
    prefill_s = first_token_at - started
    decode_s = finished - first_token_at
    return {
        "batch": batch,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": batch * len(prompts[0]) / prefill_s,
        "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s,
        "decode_ms_per_step": 1000 * decode_s / max(decode_steps, 1),
        # Time step() waited for the device: the host work of each step is ms/step minus this.
        "decode_device_wait_ms_per_step": None if decode_wait_started is None else
        1000 * (_device_wait_s(engine) - decode_wait_started) / max(decode_steps, 1),
        "steps": steps,
        "preemptions_total": engine.stats().preemptions_total,
    }


def profile_collectives(engine, prompts, steps: int) -> dict:
    """Run `prompts` to their first tokens, then profile `steps` decode steps on rank 0: the collectives' time per
    step (NCCL kernels on the device; c10d ops on the host for gloo) and its share of a step's wall time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    SamplingParams = sys.modules[type(engine).__module__].SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"profile-{len(prompts)}-{index}", prompt, params)
    started_requests: set[str] = set()
    while len(started_requests) < len(prompts):
        started_requests.update(o.request_id for o in engine.step() if o.completion_tokens >= 1)
    on_cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if on_cuda:
            torch.cuda.synchronize(engine.device)
        window_s = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    if on_cuda:
        kernels = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
        collectives = [event for event in kernels if "nccl" in event.name.lower()]
        device_busy_s = sum(event.time_range.elapsed_us() for event in kernels) / 1e6
    else:
        kernels = []
        collectives = [event for event in profiler.events() if event.name.startswith("c10d::")]
        device_busy_s = None
    collective_s = sum(event.time_range.elapsed_us() for event in collectives) / 1e6
    return {
        "steps": steps,
        "step_ms": 1000 * window_s / steps,
        "collective_ms_per_step": 1000 * collective_s / steps,
        "collective_share_of_step": collective_s / window_s,
        "collective_calls_per_step": len(collectives) / steps,
        "kernel_ms_per_step": None if device_busy_s is None else 1000 * device_busy_s / steps,
        "kernels_per_step": len(kernels) / steps if on_cuda else None,
    }


def _device_wait_s(engine) -> float | None:
    """The engine's time spent waiting for the device; None for engines older than the overlap of steps (which
    bench/revisions.py also runs through `run_engine`)."""
    return getattr(engine, "device_wait_s", None)


def run_hf(folder: str, device: str, batch_sizes: list[int], prompts_for, new_tokens: int,
           without_fla: bool, random_weights_seed: int | None = None) -> list[dict]:
    if without_fla:
        sys.modules["fla"] = None  # transformers then uses its plain-torch GDN path (the engine is done with fla)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_weights_seed is None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    else:
        from hybridkv.sidecar.random_weights import fill_transformers_model

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16).eval()
        fill_transformers_model(model, _config(folder), random_weights_seed)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    results = []
    for batch in batch_sizes:
        input_ids = torch.tensor(prompts_for(batch), device=device)
        with torch.inference_mode():
            # Prefill alone: one forward over the prompts (what generate's first step does).
            synchronize()
            started = time.perf_counter()
            model(input_ids, logits_to_keep=1)
            synchronize()
            prefill_s = time.perf_counter() - started
            started = time.perf_counter()
            out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
            synchronize()
            total_s = time.perf_counter() - started
        assert out.shape[1] == input_ids.shape[1] + new_tokens
        decode_s = max(total_s - prefill_s, 1e-9)
        results.append({
            "batch": batch,
            "prefill_tokens_per_s": batch * input_ids.shape[1] / prefill_s,
            "generate_s": total_s,
            "generate_tokens_per_s": batch * new_tokens / total_s,
            "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s,
        })
        print(f"  transformers batch {batch}: {results[-1]['generate_tokens_per_s']:.1f} tok/s end to end")
    del model
    gc.collect()
    return results


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        return json.load(handle)


def expert_bytes_not_read(geometry, batch: int, tp: int) -> float:
    """Expected bytes of one rank's experts a decode step of `batch` tokens does not touch (uniform routing), as the
    checkpoint stores them."""
    if not geometry.is_moe:
        return 0.0
    from hybridkv.sizing.geometry import dtype_bytes

    experts, top_k = geometry.num_experts, geometry.num_experts_per_tok
    untouched = experts * (1 - top_k / experts) ** batch
    hidden, width = geometry.hidden_size, geometry.moe_intermediate_size // tp
    quantization = geometry.quantization
    name = f"model.layers.{min(geometry.sparse_layer_ids)}.mlp.experts.0.down_proj"
    if quantization is not None and quantization.converts(name):
        # As stored (FP8 experts: one byte per weight and a scale per block).
        expert_bytes = sum(tensor.nbytes for out_features, in_features in ((width, hidden), (width, hidden),
                                                                           (hidden, width))
                           for tensor in quantization.stored_tensors(out_features, in_features))
    else:
        expert_bytes = 3 * hidden * width * dtype_bytes(geometry.dtype)
    return len(geometry.sparse_layer_ids) * untouched * expert_bytes


def decode_roofline_tokens_per_s(rank_bytes, batch: int, mean_context: float, bandwidth_tbs: float,
                                 unread_weight_bytes: float = 0.0) -> float:
    """Every decode step reads the weights once (less the experts no token is routed to), reads and writes each
    request's recurrent and conv state, and reads its attention KV; tokens per second if nothing but that traffic
    took time. The bytes are one rank's: with tensor parallelism the ranks read their shares at once, each from its
    own GPU's memory."""
    step_bytes = (rank_bytes.weights_bytes - unread_weight_bytes + batch * 2 * rank_bytes.bytes_per_request
                  + batch * mean_context * rank_bytes.bytes_per_token)
    return batch / (step_bytes / (bandwidth_tbs * 1e12))


def capacity_comparison(report: dict) -> dict:
    predicted = report["predicted"]
    rows = {}
    for key in ("budget_bytes", "reserve_bytes", "weights_bytes", "token_blocks", "token_capacity", "state_slots"):
        measured, planned = report[key], predicted[key]
        rows[key] = {"measured": measured, "predicted": planned,
                     "error_pct": 100.0 * (planned - measured) / measured if measured else None}
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.core.engine import Engine, format_startup_phases

    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        print("bench/throughput.py measures GPU throughput; no CUDA device is visible", file=sys.stderr)
        return 2
    folder = ensure_checkpoint(args)
    ceilings = None
    if on_cuda:  # before the engine takes the memory the copy buffers need
        from kernel_speed import ceilings as measure_ceilings

        ceilings = measure_ceilings()
        gc.collect()
        torch.cuda.empty_cache()
        print(f"measured copy {ceilings['copy_tbps']:.2f} TB/s, bf16 matmul {ceilings['matmul_bf16_tflops']:.0f} "
              "TFLOP/s")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # fla's kernels need a GPU: on CPU transformers must take its plain-torch path even when fla is installed.
    hf_without_fla = args.hf_without_fla or not on_cuda
    hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    started = time.perf_counter()
    random_seed = args.seed if args.load_format == "random" else None
    engine = Engine(EngineConfig(
        model=folder, device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        load_format=args.load_format,
        # Every prompt of a batch is admitted as soon as it fits, so the decode rows time full batches: held back
        # (the serving default), the last prompts of a batch would wait and finish late, in partial batches.
        min_prefill_tokens_with_decodes=0,
    ))
    startup_s = time.perf_counter() - started
    vocab = engine.geometry.vocab_size
    prompts_for = lambda batch: random_prompts(batch, args.prompt_len, vocab, args.seed + batch)  # noqa: E731
    report = engine.capacity().to_dict()
    memory = engine.memory
    runner = engine.runner
    print(format_startup_phases(engine.startup_phases))
    print(f"engine start-up {startup_s:.1f} s (CUDA graphs: {bool(runner.graphs)}, capture "
          f"{runner.graph_capture_s:.1f} s, graph memory {runner.graph_memory_bytes / 2**20:.0f} MiB)")
    # Warm-up at the largest batch: the first calls compile and autotune the prefill path for full-size chunks.
    run_engine(engine, random_prompts(max(batch_sizes), args.prompt_len, vocab, args.seed - 1), 2)
    engine_rows = []
    mean_context = args.prompt_len + args.new_tokens / 2
    for batch in batch_sizes:
        row = run_engine(engine, prompts_for(batch), args.new_tokens)
        unread = expert_bytes_not_read(engine.geometry, batch, args.tensor_parallel_size)
        row["decode_roofline_tokens_per_s"] = decode_roofline_tokens_per_s(engine.rank_bytes, batch, mean_context,
                                                                           args.bandwidth_tbs, unread)
        row["decode_pct_of_roofline"] = 100.0 * row["decode_tokens_per_s"] / row["decode_roofline_tokens_per_s"]
        if ceilings is not None:
            at_copy = decode_roofline_tokens_per_s(engine.rank_bytes, batch, mean_context, ceilings["copy_tbps"],
                                                   unread)
            row["decode_pct_of_measured_copy"] = 100.0 * row["decode_tokens_per_s"] / at_copy
        if args.tensor_parallel_size > 1 and args.collective_steps:
            row["collectives"] = profile_collectives(engine, prompts_for(batch), args.collective_steps)
        engine_rows.append(row)
        print(f"  engine batch {batch}: decode {row['decode_tokens_per_s']:.0f} tok/s "
              f"({row['decode_pct_of_roofline']:.0f}% of roofline), prefill {row['prefill_tokens_per_s']:.0f} tok/s"
              + (f", collectives {100 * row['collectives']['collective_share_of_step']:.1f}% of a step"
                 if "collectives" in row else ""))
    result = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "tiny": args.tiny,
        "load_format": args.load_format,
        "quantize": args.quantize,
        "tensor_parallel_size": args.tensor_parallel_size,
        "bandwidth_tbs": args.bandwidth_tbs,
        "ceilings": ceilings,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "engine": {"startup_s": startup_s, "startup_phases": dict(engine.startup_phases),
                   "model_info": engine.model_info(), "rows": engine_rows,
                   "memory": {"total_memory_bytes": memory.total_memory_bytes,
                              "activation_peak_bytes": memory.activation_peak_bytes,
                              "graph_bytes": memory.graph_bytes,
                              "graph_memory_after_pools_bytes": engine.runner.graph_memory_bytes}},
        "transformers": {"with_fla": not hf_without_fla, "rows": []},
        "capacity": {"report": report, "comparison": capacity_comparison(report)},
    }
    write_json(args.out, result)  # the engine's figures survive even if the baseline fails
    engine.close()
    del engine, runner
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    hf_rows = run_hf(folder, args.device, hf_batch_sizes, prompts_for, args.new_tokens, hf_without_fla,
                     random_seed) if hf_batch_sizes else []
    result["transformers"]["rows"] = hf_rows
    write_json(args.out, result)
    print_tables(args, result)
    return 0


def write_json(path: str, result: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {path}")


def print_tables(args, result: dict) -> None:
    """Markdown tables, ready for docs/performance.md."""
    hf_by_batch = {row["batch"]: row for row in result["transformers"]["rows"]}
    scale = " (tiny: scaled down, a smoke run)" if args.tiny else ""
    fla = "with" if result["transformers"]["with_fla"] else "without"
    ranks = f", tp={args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"\n{args.model}{scale}{ranks}, random {args.quantize or 'bf16'} weights, {result['device']}, torch "
          f"{result['torch']}; prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens, greedy; transformers {fla} fla; `{result['command']}`\n")
    ceilings = result.get("ceilings")
    copy = f"{ceilings['copy_tbps']:.2f} TB/s measured" if ceilings else "not measured"
    print(f"| batch | decode tok/s | roofline tok/s ({result.get('bandwidth_tbs', args.bandwidth_tbs)} TB/s) | % of "
          f"roofline | % at the copy rate ({copy}) | ms/step | of which device wait | prefill tok/s | engine "
          "end-to-end tok/s | transformers tok/s | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["engine"]["rows"]:
        hf = hf_by_batch.get(row["batch"])
        engine_end_to_end = row["batch"] * args.new_tokens / (row["prefill_s"] + row["decode_s"])
        hf_rate = f"{hf['generate_tokens_per_s']:.1f}" if hf else "-"
        speedup = f"{engine_end_to_end / hf['generate_tokens_per_s']:.1f}x" if hf else "-"
        wait = row["decode_device_wait_ms_per_step"]
        wait_text = "-" if wait is None else f"{wait:.2f}"
        at_copy = row.get("decode_pct_of_measured_copy")
        print(f"| {row['batch']} | {row['decode_tokens_per_s']:.0f} | {row['decode_roofline_tokens_per_s']:.0f} | "
              f"{row['decode_pct_of_roofline']:.0f}% | {'-' if at_copy is None else f'{at_copy:.0f}%'} | "
              f"{row['decode_ms_per_step']:.2f} | {wait_text} | "
              f"{row['prefill_tokens_per_s']:.0f} | {engine_end_to_end:.0f} | {hf_rate} | {speedup} |")
    print("\nDevice wait: the part of ms/step the engine spent waiting for the GPU's sampled ids (0 on CPU); the rest "
          "is host work.\nEnd-to-end and transformers: generated tokens / wall time of the whole generation, prefill "
          "included.\n")
    print("| capacity | measured (engine) | predicted (planner, before start-up) | error |")
    print("|---|---:|---:|---:|")
    for key, row in result["capacity"]["comparison"].items():
        error = "n/a (not measured)" if row["error_pct"] is None else f"{row['error_pct']:+.2f}%"
        print(f"| {key} | {row['measured']:,} | {row['predicted']:,} | {error} |")
    profiled = [row for row in result["engine"]["rows"] if "collectives" in row]
    if profiled:
        where = "NCCL kernels" if result["device"] != "cpu" else "c10d ops on the host, gloo"
        print(f"\nCollectives on rank 0 ({where}), {profiled[0]['collectives']['steps']} profiled decode steps:\n")
        print("| batch | step ms (profiled) | collective ms/step | share of step | collectives/step |")
        print("|---:|---:|---:|---:|---:|")
        for row in profiled:
            c = row["collectives"]
            print(f"| {row['batch']} | {c['step_ms']:.2f} | {c['collective_ms_per_step']:.3f} | "
                  f"{100 * c['collective_share_of_step']:.1f}% | {c['collective_calls_per_step']:.0f} |")


def run_script(main) -> None:
    """Runs a bench script's `main` and exits with its code; a model or flag the engine refuses (`UserError`) ends
    the script with its message and exit code 2, not a traceback. Shared by the scripts that build an engine."""
    from hybridkv.errors import UserError

    try:
        code = main()
    except UserError as err:
        print(f"{os.path.basename(sys.argv[0])}: {err}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    run_script(main)
