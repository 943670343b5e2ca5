"""Plain-text rendering of a plan: the chosen settings and why, memory per rank, the pools, and the allocators side by
side on the same budget (hybridkv dual pool, vLLM 0.20 none mode, vLLM 0.33 align mode, the ideal bound)."""

from __future__ import annotations

from hybridkv.sizing.planner import Plan

GIB = 1 << 30
MIB = 1 << 20


def _gib(value: int) -> str:
    return f"{value / GIB:,.2f} GiB"


def render_table(header: list[str], rows: list[list[str]], align_left: int = 1) -> list[str]:
    """A fixed-width table; the first `align_left` columns are left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(widths[i]) if i < align_left else cell.rjust(widths[i]) for i, cell in enumerate(cells)
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(row) for row in rows)]


def _checkpoint_ladder(sizing: dict) -> str:
    """The replay that sized the checkpoint pool: prompt tokens hit at each slot count tried."""
    tried = ", ".join(f"{step['slots']:,}: {step['hit_fraction']:.1%}" for step in sizing["tried"])
    scaled = (f", scaled to {sizing['slots']:,} for {sizing['conversations']:,}"
              if sizing["replayed_conversations"] < sizing["conversations"] else "")
    return (f"              sized by replaying {sizing['replayed_conversations']:,} chats, prompt tokens hit at the "
            f"slots tried: {tried} (took {sizing['replayed_slots']:,}{scaled})")


def render_plan(plan: Plan) -> str:
    prediction = plan.prediction
    layout = prediction.layout
    rank = prediction.rank_bytes
    gpu = plan.gpu
    parameters = plan.geometry.parameters_per_rank(plan.tensor_parallel_size)
    lines = [
        f"hybridkv plan {plan.spec_name}: {plan.geometry.name} on {plan.tensor_parallel_size} × "
        f"{gpu.display_name} ({gpu.memory_mib:,} MiB each)",
        "",
        "settings (sidecar flags)",
        f"  --tensor-parallel-size {plan.tensor_parallel_size} --gpu-memory-utilization "
        f"{plan.gpu_memory_utilization} --max-num-seqs {plan.max_num_seqs} --max-model-len {plan.max_model_len} "
        f"--block-size {layout.block_size}"
        + (f" --kv-cache-memory {plan.kv_cache_memory_bytes}" if plan.kv_cache_memory_bytes is not None else "")
        + (f" --enable-prefix-caching --prefix-checkpoint-slots {layout.checkpoint_slots} "
           f"--prefix-checkpoint-interval {plan.checkpoint_interval_tokens}" if plan.prefix_caching
           else " --no-enable-prefix-caching"),
        "why",
        *(f"  - {reason}" for reason in plan.reasons),
        "",
        "memory per rank (predicted before deployment)",
        f"  requested   {_gib(prediction.requested_bytes)}  = ceil({gpu.memory_bytes:,} B × "
        f"{plan.gpu_memory_utilization})",
        f"  weights     {_gib(prediction.weights_bytes)}  ({parameters:,} parameters per rank, {plan.geometry.dtype})",
        f"  reserve     {_gib(prediction.reserve_bytes)}  (estimate: activations at {plan.max_num_batched_tokens} "
        "batched tokens, sampler, CUDA graphs, CUDA context; see docs/capacity.md)",
        f"  margin      {_gib(plan.safety_margin_bytes)}  (kept free of the target: reserve may be "
        f"{1 + plan.reserve_margin}× the estimate)",
        f"  cache       {_gib(prediction.budget_bytes)}",
        "",
        "dual pool",
        f"  state pool  {layout.state_slots:,} slots (+1 null) × {rank.bytes_per_request / MIB:,.2f} MiB "
        f"= {_gib(layout.state_pool_bytes)}  (conv {rank.conv_dtype}, recurrent {rank.ssm_dtype})",
        *([f"  checkpoints {layout.checkpoint_slots:,} slots × {rank.bytes_per_request / MIB:,.2f} MiB = "
           f"{_gib(layout.checkpoint_pool_bytes)}  (prefix caching; costs {layout.checkpoint_attention_tokens:,} "
           "attention tokens)"] if plan.prefix_caching else []),
        *([_checkpoint_ladder(plan.checkpoint_sizing)] if plan.checkpoint_sizing else []),
        f"  token pool  {layout.token_blocks:,} blocks (+1 null) × {layout.block_size} tokens × "
        f"{rank.bytes_per_token:,} B = {_gib(layout.token_pool_bytes)}  (KV {rank.kv_dtype})",
        f"  capacity    {layout.token_capacity:,} tokens; required {plan.target_tokens:,} ({plan.requirement}); "
        f"{plan.full_length_requests} at the full {plan.max_model_len:,} tokens at once, or all {plan.max_num_seqs} "
        f"at a mean of {plan.mean_tokens_all_running:,}",
        *(f"  state dtype {dtype} recurrent state: {tokens:,} tokens" for dtype, tokens in plan.state_dtypes.items()),
        "",
        f"allocators on the same GPU memory: {_gib(prediction.budget_bytes)} per rank for hybridkv and the ideal "
        f"bound, {_gib(plan.vllm_budget_bytes)} for vLLM"
        + (" (it also loads the vision tower)" if plan.vllm_budget_bytes != prediction.budget_bytes else ""),
    ]
    rows = []
    for figures in plan.allocator_figures().values():
        breakdown = figures["bytes"]
        rows.append([
            figures["label"],
            f"{figures['block_size']:,}",
            f"{figures['token_capacity']:,}",
            f"{figures['token_capacity_one_request']:,}",
            f"{figures['max_concurrency_at_max_model_len']:,}",
            _gib(breakdown["padding_bytes"] + breakdown["extra_state_bytes"] + breakdown["idle_state_bytes"]),
        ])
    header = [
        "allocator",
        "block",
        f"tokens, {plan.max_num_seqs} running",
        "tokens, 1 running",
        f"max running at {plan.max_model_len:,} tok",
        "padding, extra + idle state",
    ]
    lines.extend("  " + line for line in render_table(header, rows))
    for figures in plan.allocator_figures().values():
        log = figures["vllm_startup_log"]
        if log is not None:
            lines.append(f"  {figures['label']} ({figures['rule']}) would log: " + "; ".join(log["lines"]))
    lines.append(
        "  tokens: attention-KV tokens the pool holds with that many requests resident (vLLM lends idle state blocks "
        "to tokens; the dual pool keeps max_num_seqs slots reserved); padding, extra + idle state: state-page "
        f"padding, align-mode checkpoint blocks and unused reserved slots with {plan.max_num_seqs} running."
    )
    if plan.prefix_caching:
        tokens = layout.checkpoint_pool_bytes // prediction.rank_bytes.bytes_per_token
        lines.append(f"  The dual pool's tokens are those left beside its {layout.checkpoint_slots} prefix-cache "
                     f"checkpoints ({tokens:,} attention tokens; --no-prefix-caching plans without them); vLLM 0.20's "
                     "none mode caches no prefixes.")
    return "\n".join(lines)
