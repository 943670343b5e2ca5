"""Three cache allocators over one memory budget, computed by one code path (`PoolModel`).

- **hybridkv dual pool**: a state pool of `max_num_seqs + 1` slots (slot 0 null) holds each running request's GDN
  state; everything else is a paged token pool of `block_size`-token blocks (block 0 null).
- **vLLM shared pool** (vLLM 0.19–0.33, `Platform._align_hybrid_block_size` and `kv_cache_utils`): one block pool for
  attention and GDN state; the attention block is raised to `B = α·ceil(g / (α·a))` tokens so one attention page
  `P = B·a` holds one GDN state page `g` (padded to `P`); layers are grouped (`gs` layers per group, one tensor per
  group position), one block id spans `gs` pages, block 0 is null. "vLLM 0.20, none mode": α = 16, one state block
  per GDN group per request. "vLLM 0.33, align mode" (prefix caching on by default) depends on the GPU: where
  FlashInfer's GDN prefill runs (SM90; SM100/SM120 with CUDA ≥ 13) α = lcm(16, 64) for its checkpoint grid and a
  request pins up to 3 state blocks per GDN group (2 live + 1 prefill checkpoint, `MambaSpec.max_memory_usage_bytes`);
  elsewhere the Triton GDN prefill runs: α = 16 and 2 state blocks per GDN group.
- **ideal bound**: every byte not holding a running request's state holds tokens, at token granularity.

Each becomes a `PoolModel`: a pool of `pool_units` allocation units in which a request needs `state_units_per_request`
units plus `units_per_block` units per `block_size` tokens, with at most `max_running` requests. Token capacity at a
concurrency, max concurrency for a request length, the byte breakdown, vLLM's start-up log figures and the workload
replay all read that one model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridkv.sizing.errors import CapacityError
from hybridkv.sizing.memory import RankBytes

DEFAULT_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 4096
MAX_NUM_SEQS = 65_536
# vLLM's attention kernel block alignment (FlashAttention / FlashInfer) and the FlashInfer GDN checkpoint grid.
VLLM_KERNEL_BLOCK_ALIGNMENT_TOKENS = 16
VLLM_GDN_CHECKPOINT_ALIGNMENT_TOKENS = 64
# Compute capabilities where vLLM 0.33 runs FlashInfer's GDN prefill: Hopper always, Blackwell (SM100/SM120) only on a
# CUDA 13 build (`_resolve_gdn_prefill_backend`).
FLASHINFER_GDN_HOPPER_MAJOR = 9
FLASHINFER_GDN_CUDA13_MAJORS = (10, 12)
FLASHINFER_GDN_MIN_CUDA_MAJOR = 13
# Assumed: a CUDA 13 build of vLLM 0.33 (as its torch 2.11 wheels); `vllm_cuda_major` 12 describes a CUDA 12 build.
DEFAULT_VLLM_CUDA_MAJOR = 13
# vLLM groups layers by gs = min(L_attn, L_gdn) unless max < 1.5 × min (then gs = max); PR #36684.
VLLM_GROUP_SIZE_RATIO = 1.5


# The checkpoint pool's default size with prefix caching on: this fraction of the running requests' state slots, so
# it costs half as much memory as their state slots (a checkpoint is one request's GDN state at a block
# boundary). Half rather than a quarter: a chat client that re-renders its history resumes from a checkpoint taken a
# whole reply earlier, which its running request keeps (at most half the pool); on an H100, 64 such conversations
# at once with max_num_seqs 256 hit 68.6 % of their prompt tokens with 128 slots against 54.7 % with 64, and served
# 25 % more requests a second, for 3 % of the token pool (docs/performance.md).
DEFAULT_CHECKPOINT_FRACTION = 0.5
MAX_CHECKPOINT_SLOTS = 65_536


def default_checkpoint_slots(max_num_seqs: int) -> int:
    """Checkpoint slots prefix caching gets unless told otherwise: DEFAULT_CHECKPOINT_FRACTION of max_num_seqs, at
    least one."""
    return max(1, math.ceil(max_num_seqs * DEFAULT_CHECKPOINT_FRACTION))


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _check_count(value: int, what: str, lower: int, upper: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        raise CapacityError(f"{what} must be an integer in [{lower}, {upper}], got {value!r}")


# ---- the dual pool ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DualPoolLayout:
    """The dual pool carved out of a budget. Counts are usable (null slot/block excluded); bytes are allocated.

    With prefix caching on, the request-constant memory also holds `checkpoint_slots` checkpoints (no null: nothing
    reads a checkpoint by default), each one request's GDN state, taken out of the budget before the token blocks."""

    block_size: int
    state_slots: int
    token_blocks: int
    token_capacity: int
    state_pool_bytes: int  # (state_slots + 1) × bytes_per_request
    token_pool_bytes: int  # (token_blocks + 1) × block_size × bytes_per_token
    budget_bytes: int
    bytes_per_token: int
    bytes_per_request: int
    checkpoint_slots: int = 0
    checkpoint_pool_bytes: int = 0  # checkpoint_slots × bytes_per_request

    @property
    def checkpoint_attention_tokens(self) -> int:
        """Attention tokens the checkpoint pool's bytes would otherwise hold."""
        return self.checkpoint_pool_bytes // self.bytes_per_token

    @property
    def state_pool_usable_bytes(self) -> int:
        return self.state_slots * self.bytes_per_request

    @property
    def token_pool_usable_bytes(self) -> int:
        return self.token_blocks * self.block_size * self.bytes_per_token

    @property
    def unused_bytes(self) -> int:
        """Budget left over because it is smaller than one token block."""
        return self.budget_bytes - self.state_pool_bytes - self.checkpoint_pool_bytes - self.token_pool_bytes

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "state_slots": self.state_slots,
            "token_blocks": self.token_blocks,
            "token_capacity": self.token_capacity,
            "state_pool_bytes": self.state_pool_bytes,
            "token_pool_bytes": self.token_pool_bytes,
            "state_pool_usable_bytes": self.state_pool_usable_bytes,
            "token_pool_usable_bytes": self.token_pool_usable_bytes,
            "checkpoint_slots": self.checkpoint_slots,
            "checkpoint_pool_bytes": self.checkpoint_pool_bytes,
            "checkpoint_attention_tokens": self.checkpoint_attention_tokens,
            "budget_bytes": self.budget_bytes,
            "unused_bytes": self.unused_bytes,
        }


def readable_bytes(value: int, rounding) -> str:
    """Bytes below 1 MiB, else MiB or GiB to two decimals rounded with `rounding`, so a budget rounded down and a
    need rounded up never print as the same figure."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if value >= size:
            return f"{rounding(value * 100 / size) / 100:,.2f} {unit}"
    return f"{value:,} bytes"


def dual_pool_layout(
    rank_bytes: RankBytes, budget_bytes: int, max_num_seqs: int, block_size: int = DEFAULT_BLOCK_SIZE,
    checkpoint_slots: int = 0,
) -> DualPoolLayout:
    """Split `budget_bytes` into `max_num_seqs + 1` state slots, `checkpoint_slots` state checkpoints (prefix caching)
    and as many token blocks as fit (slots and blocks with a null).

    Raises CapacityError when the budget cannot hold the slots plus at least one usable token block.
    """
    _check_count(max_num_seqs, "max_num_seqs", 1, MAX_NUM_SEQS)
    _check_count(block_size, "block_size", 1, MAX_BLOCK_SIZE)
    _check_count(checkpoint_slots, "checkpoint_slots", 0, MAX_CHECKPOINT_SLOTS)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise CapacityError(f"the cache budget must be an integer number of bytes, got {budget_bytes!r}")
    state_pool_bytes = (max_num_seqs + 1) * rank_bytes.bytes_per_request
    checkpoint_pool_bytes = checkpoint_slots * rank_bytes.bytes_per_request
    block_bytes = block_size * rank_bytes.bytes_per_token
    allocated_blocks = max(0, budget_bytes - state_pool_bytes - checkpoint_pool_bytes) // block_bytes
    if allocated_blocks < 2:
        needed = state_pool_bytes + checkpoint_pool_bytes + 2 * block_bytes
        checkpoints = (f" and {checkpoint_slots} checkpoints ({readable_bytes(checkpoint_pool_bytes, math.ceil)})"
                       if checkpoint_slots else "")
        raise CapacityError(
            f"a cache budget of {readable_bytes(budget_bytes, math.floor)} per rank cannot hold {max_num_seqs} "
            f"state slots (+1 null, {readable_bytes(state_pool_bytes, math.ceil)}){checkpoints} and one usable "
            f"{block_size}-token block (+1 null); it needs at least {readable_bytes(needed, math.ceil)}: lower "
            f"max_num_seqs{' or the checkpoint slots' if checkpoint_slots else ''}, raise gpu_memory_utilization or "
            "use more GPUs"
        )
    token_blocks = allocated_blocks - 1
    return DualPoolLayout(
        block_size=block_size,
        state_slots=max_num_seqs,
        token_blocks=token_blocks,
        token_capacity=token_blocks * block_size,
        state_pool_bytes=state_pool_bytes,
        token_pool_bytes=allocated_blocks * block_bytes,
        budget_bytes=budget_bytes,
        bytes_per_token=rank_bytes.bytes_per_token,
        bytes_per_request=rank_bytes.bytes_per_request,
        checkpoint_slots=checkpoint_slots,
        checkpoint_pool_bytes=checkpoint_pool_bytes,
    )


def dual_pool_max_concurrency(
    rank_bytes: RankBytes, budget_bytes: int, request_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """Most requests of `request_tokens` the dual pool holds when max_num_seqs is sized for exactly that length.

    s slots (+1 null) and s × ceil(tokens / block) blocks (+1 null) must fit: the largest such s (0 if none).
    """
    block_bytes = block_size * rank_bytes.bytes_per_token
    per_request = rank_bytes.bytes_per_request + _ceil_div(request_tokens, block_size) * block_bytes
    return max(0, (budget_bytes - rank_bytes.bytes_per_request - block_bytes) // per_request)


# ---- allocators as data ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Allocator:
    key: str
    label: str
    layout: str  # "dual", "shared" or "ideal"
    kernel_alignment_tokens: int = VLLM_KERNEL_BLOCK_ALIGNMENT_TOKENS
    state_blocks_per_group: int = 1
    rule: str = ""  # which of vLLM's rules this allocator follows, in words


DUAL_POOL = Allocator("hybridkv", "hybridkv dual pool", "dual", rule="one state slot per running request, 16-token blocks")
VLLM_0_20_NONE = Allocator(
    "vllm-0.20-none", "vLLM 0.20, none mode", "shared",
    rule="16-token alignment, 1 state block per GDN group (prefix caching off)",
)
VLLM_0_33_ALIGN = Allocator(
    "vllm-0.33-align",
    "vLLM 0.33, align mode",
    "shared",
    kernel_alignment_tokens=math.lcm(VLLM_KERNEL_BLOCK_ALIGNMENT_TOKENS, VLLM_GDN_CHECKPOINT_ALIGNMENT_TOKENS),
    state_blocks_per_group=3,
    rule="FlashInfer GDN prefill: 64-token alignment, 3 state blocks per GDN group (2 live + 1 prefill checkpoint)",
)
VLLM_0_33_ALIGN_TRITON = Allocator(
    "vllm-0.33-align",
    "vLLM 0.33, align mode",
    "shared",
    state_blocks_per_group=2,
    rule="Triton GDN prefill: 16-token alignment, 2 state blocks per GDN group (no prefill checkpoint)",
)
IDEAL = Allocator("ideal", "ideal bound", "ideal", rule="token granularity, no padding, no null block")


def runs_flashinfer_gdn_prefill(compute_capability: tuple[int, int] | None, cuda_major: int) -> bool:
    """Whether vLLM 0.33 picks FlashInfer's GDN prefill on this GPU (`_resolve_gdn_prefill_backend`)."""
    if compute_capability is None:
        return False
    major = compute_capability[0]
    return major == FLASHINFER_GDN_HOPPER_MAJOR or (
        major in FLASHINFER_GDN_CUDA13_MAJORS and cuda_major >= FLASHINFER_GDN_MIN_CUDA_MAJOR
    )


def vllm_align_allocator(
    compute_capability: tuple[int, int] | None, cuda_major: int = DEFAULT_VLLM_CUDA_MAJOR
) -> Allocator:
    """vLLM 0.33's align-mode allocator on a GPU of this compute capability, its rule naming the architecture."""
    sm = "unknown compute capability" if compute_capability is None else "SM{}{}".format(*compute_capability)
    if runs_flashinfer_gdn_prefill(compute_capability, cuda_major):
        allocator = VLLM_0_33_ALIGN
    else:
        allocator = VLLM_0_33_ALIGN_TRITON
    return replace(allocator, rule=f"{sm}, CUDA {cuda_major}: {allocator.rule}")


def allocators_for(
    compute_capability: tuple[int, int] | None, cuda_major: int = DEFAULT_VLLM_CUDA_MAJOR
) -> tuple[Allocator, ...]:
    """The four allocators on one GPU architecture (dual pool first)."""
    return DUAL_POOL, VLLM_0_20_NONE, vllm_align_allocator(compute_capability, cuda_major), IDEAL


@dataclass(frozen=True)
class SharedPoolGeometry:
    """vLLM's page unification for one rank (`_align_hybrid_block_size`, `get_kv_cache_groups`, `get_num_blocks`)."""

    block_size: int  # B, the raised attention block
    page_bytes: int  # P = B × a
    state_bytes_per_layer: int  # g, unpadded
    group_size: int  # gs layers per group
    attention_groups: int
    gdn_groups: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id across the gs group tensors."""
        return self.group_size * self.page_bytes

    @property
    def padding_fraction(self) -> float:
        return (self.page_bytes - self.state_bytes_per_layer) / self.state_bytes_per_layer


def shared_pool_geometry(rank_bytes: RankBytes, kernel_alignment_tokens: int) -> SharedPoolGeometry:
    attention_page_per_token = rank_bytes.kv_bytes_per_token_per_layer
    state_page = rank_bytes.state_bytes_per_layer
    alignment = kernel_alignment_tokens
    block_size = alignment * _ceil_div(state_page, alignment * attention_page_per_token)
    attention_layers = rank_bytes.num_full_attention_layers
    gdn_layers = rank_bytes.num_linear_attention_layers
    group_size = min(attention_layers, gdn_layers)
    if max(attention_layers, gdn_layers) < VLLM_GROUP_SIZE_RATIO * group_size:
        group_size = max(attention_layers, gdn_layers)
    return SharedPoolGeometry(
        block_size=block_size,
        page_bytes=block_size * attention_page_per_token,
        state_bytes_per_layer=state_page,
        group_size=group_size,
        attention_groups=_ceil_div(attention_layers, group_size),
        gdn_groups=_ceil_div(gdn_layers, group_size),
    )


@dataclass(frozen=True)
class PoolModel:
    """One allocator's pool over a budget: the single description every capacity figure is computed from."""

    allocator: Allocator
    budget_bytes: int
    block_size: int  # tokens per token block (1 for the ideal bound)
    unit_bytes: int  # bytes of one allocation unit
    pool_units: int  # usable units (null block and reserved state excluded)
    units_per_block: int  # units one token block takes
    state_units_per_request: int  # units of state a running request takes from the same pool
    max_running: int  # most requests running at once (state slots / the scheduler's max_num_seqs)
    bytes_per_token: int
    bytes_per_request: int
    null_bytes: int
    reserved_state_bytes: int  # state reserved up front (dual pool: all slots + the null slot)
    shared: SharedPoolGeometry | None = None
    checkpoint_slots: int = 0  # dual pool with prefix caching: GDN state checkpoints taken out before the blocks

    @property
    def label(self) -> str:
        return self.allocator.label

    def blocks_for(self, tokens: int) -> int:
        return _ceil_div(tokens, self.block_size)

    def units_for_request(self, tokens: int) -> int:
        """Units a running request of `tokens` tokens holds (its state plus its token blocks)."""
        return self.state_units_per_request + self.blocks_for(tokens) * self.units_per_block

    def token_capacity(self, concurrency: int) -> int:
        """Attention tokens the pool can hold while `concurrency` requests are resident (0 if they cannot be)."""
        if concurrency > self.max_running:
            return 0
        free_units = self.pool_units - concurrency * self.state_units_per_request
        return max(0, free_units // self.units_per_block) * self.block_size

    def max_concurrency(self, request_tokens: int) -> int:
        """Most requests of `request_tokens` tokens each that can be resident at once."""
        return min(self.max_running, self.pool_units // self.units_for_request(request_tokens))

    def vllm_startup_log(self, max_model_len: int) -> dict | None:
        """What vLLM prints at start-up for this pool (None for layouts vLLM does not build).

        Concurrency = num_blocks / Σ_groups ceil(max_memory_usage / page) (`get_max_concurrency_for_kv_cache_config`):
        ceil(L / B) blocks per attention group and the per-group state blocks. 0.20 logs num_blocks // groups × B
        tokens (`_report_kv_cache_config`); 0.21+ logs int(concurrency × max_model_len) (`get_kv_cache_capacity`).
        """
        if self.shared is None:
            return None
        num_blocks = self.pool_units + 1 if self.null_bytes else 0
        blocks_per_request = self.blocks_for(max_model_len) * self.units_per_block + self.state_units_per_request
        concurrency = num_blocks / blocks_per_request
        if self.allocator.key == VLLM_0_20_NONE.key:
            groups = self.shared.attention_groups + self.shared.gdn_groups
            tokens = num_blocks // groups * self.block_size
        else:
            tokens = int(concurrency * max_model_len)
        return {
            "num_blocks": num_blocks,
            "gpu_kv_cache_tokens": tokens,
            "max_concurrency": round(concurrency, 2),
            "lines": [
                f"GPU KV cache size: {tokens:,} tokens",
                f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x",
            ],
        }

    def breakdown(self, concurrency: int) -> dict[str, int]:
        """Where the budget goes with `concurrency` requests resident and the rest of the pool given to tokens.

        state: one live state per running request; extra_state: further state blocks a request pins (vLLM align
        mode's checkpoints); idle_state: reserved slots no request uses (dual pool); padding: page padding.
        """
        running = min(concurrency, self.max_running)
        token_units = (self.token_capacity(running) // self.block_size) * self.units_per_block
        live_state_bytes = running * self.bytes_per_request
        if self.allocator.layout == "dual":
            state_bytes_spent = self.reserved_state_bytes - self.bytes_per_request  # the null slot is in null_bytes
            extra_state_bytes = padding_bytes = 0
            idle_state_bytes = state_bytes_spent - live_state_bytes
        else:
            state_bytes_spent = running * self.state_units_per_request * self.unit_bytes
            copies = self.allocator.state_blocks_per_group if self.allocator.layout == "shared" else 1
            extra_state_bytes = (copies - 1) * live_state_bytes
            idle_state_bytes = 0
            padding_bytes = state_bytes_spent - copies * live_state_bytes
        checkpoint_bytes = self.checkpoint_slots * self.bytes_per_request
        spent = token_units * self.unit_bytes + state_bytes_spent + checkpoint_bytes + self.null_bytes
        return {
            "token_bytes": token_units * self.unit_bytes,
            "state_bytes": live_state_bytes,
            "checkpoint_bytes": checkpoint_bytes,
            "extra_state_bytes": extra_state_bytes,
            "idle_state_bytes": idle_state_bytes,
            "padding_bytes": padding_bytes,
            "null_bytes": self.null_bytes,
            "unused_bytes": self.budget_bytes - spent,
        }


def pool_model(
    allocator: Allocator,
    rank_bytes: RankBytes,
    budget_bytes: int,
    max_num_seqs: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    checkpoint_slots: int = 0,
) -> PoolModel:
    """The pool `allocator` builds from `budget_bytes` per rank with `max_num_seqs` requests allowed to run
    (`checkpoint_slots`: the dual pool's prefix-cache checkpoints; the other layouts keep state in their one pool)."""
    _check_count(max_num_seqs, "max_num_seqs", 1, MAX_NUM_SEQS)
    common = {
        "allocator": allocator,
        "budget_bytes": budget_bytes,
        "max_running": max_num_seqs,
        "bytes_per_token": rank_bytes.bytes_per_token,
        "bytes_per_request": rank_bytes.bytes_per_request,
    }
    if allocator.layout == "dual":
        layout = dual_pool_layout(rank_bytes, budget_bytes, max_num_seqs, block_size, checkpoint_slots)
        block_bytes = block_size * rank_bytes.bytes_per_token
        return PoolModel(
            checkpoint_slots=checkpoint_slots,
            block_size=block_size,
            unit_bytes=block_bytes,
            pool_units=layout.token_blocks,
            units_per_block=1,
            state_units_per_request=0,
            null_bytes=block_bytes + rank_bytes.bytes_per_request,
            reserved_state_bytes=layout.state_pool_bytes,
            **common,
        )
    if allocator.layout == "shared":
        shared = shared_pool_geometry(rank_bytes, allocator.kernel_alignment_tokens)
        num_blocks = max(0, budget_bytes) // shared.block_bytes
        return PoolModel(
            block_size=shared.block_size,
            unit_bytes=shared.block_bytes,
            pool_units=max(0, num_blocks - 1),
            units_per_block=shared.attention_groups,
            state_units_per_request=shared.gdn_groups * allocator.state_blocks_per_group,
            null_bytes=shared.block_bytes if num_blocks else 0,
            reserved_state_bytes=0,
            shared=shared,
            **common,
        )
    return PoolModel(
        block_size=1,
        unit_bytes=1,
        pool_units=max(0, budget_bytes),
        units_per_block=rank_bytes.bytes_per_token,
        state_units_per_request=rank_bytes.bytes_per_request,
        null_bytes=0,
        reserved_state_bytes=0,
        **common,
    )


def pool_models(
    rank_bytes: RankBytes,
    budget_bytes: int,
    max_num_seqs: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    compute_capability: tuple[int, int] | None,
    cuda_major: int = DEFAULT_VLLM_CUDA_MAJOR,
    vllm_budget_bytes: int | None = None,
    checkpoint_slots: int = 0,
) -> dict[str, PoolModel]:
    """Every allocator over the same budget on one GPU architecture, keyed by allocator key (dual pool first).

    `vllm_budget_bytes` is the budget vLLM's own columns get when it differs (vLLM loads a VL checkpoint's vision tower);
    `checkpoint_slots` are the dual pool's prefix-cache checkpoints.
    """
    vllm_budget = budget_bytes if vllm_budget_bytes is None else vllm_budget_bytes
    return {
        a.key: pool_model(a, rank_bytes, vllm_budget if a.layout == "shared" else budget_bytes, max_num_seqs,
                          block_size, checkpoint_slots if a.layout == "dual" else 0)
        for a in allocators_for(compute_capability, cuda_major)
    }
