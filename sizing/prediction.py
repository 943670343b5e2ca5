"""The planner's prediction of the cache budget before deployment: weights, an explicit reserve estimate, the budget.

    requested = ceil(total_memory × gpu_memory_utilization)          (exact decimal arithmetic, as vLLM rounds)
    budget    = requested − weights_per_rank − reserve_estimate       (or exactly kv_cache_memory_bytes when given)

The reserve estimate (`estimate_reserve_bytes`) is the memory an engine needs besides weights and cache, per rank:

    reserve = fixed + activation × max_num_batched_tokens × (hidden_size + widest_projection_per_rank)
            + 32 B × min(max_num_seqs, max_num_batched_tokens) × vocab_size      (sampler: its top-p sort, below)
            + largest 4-bit weight per rank in the model dtype                   (W4A16 prefill dequantizes it)
            + 512 MiB when tp > 1                                                 (NCCL buffers)
            + piecewise CUDA graphs at G = min(2048, max_num_batched_tokens) tokens:
              arenas (exact, `piecewise_arena_bytes`) + activation × G × (hidden_size + widest_projection_per_rank)

`widest_projection_per_rank` is the widest per-token intermediate of one layer on one rank: the MLP's gate+up output
(2 × intermediate / tp), the fused MoE's rows ((top_k + 1 for a stacked shared expert) × (moe_intermediate / tp +
hidden): each choice's SwiGLU product and weighted down projection; a shared expert of its own adds its gate+up, and
the router logits count too), the GDN in-projections ((conv_dim + value_dim + 2 × v_heads) / tp) or the attention q/k/v
projections. `fixed` (CUDA context, graphs, allocator slack and the profile run's step-independent buffers) and
`activation` (bytes per element of that intermediate) are fitted on measured start-ups by
`bench/calibrate_reserve.py`, which writes them to `data/reserve.json` with the runs they were fitted on; the sampler,
dequantization and NCCL terms are not fitted (every calibration run has 256 sequences of a 16-bit checkpoint on one
GPU). The piecewise graphs' pool holds their largest piece's intermediates, counted with the fitted activation
coefficient at G tokens. The dequantization term counts only when a step can batch `W4A16_DEQUANTIZE_MIN_TOKENS`
tokens. The estimate stays the planner's input after engines measure their own reserve: prediction error is
planned-before vs measured-after, and the calibration script reports it per run.

The sampler's term is its worst case, which the engine's profile step runs: every running request's row sorted for
top-p. Per logit that holds the fp32 logits (4 B), the sampled rows' copy (4), the sort's values (4), its int64
indices out and in (8 + 8) and the sort's working storage: 32 B, the storage's share read off start-ups at 32
sequences (`docs/capacity.md`, "Fewer sequences"). At the calibration runs' 256 sequences only the split between this
term and `fixed` depends on it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import cache
from importlib import resources

from hybridkv.sizing.allocators import DEFAULT_BLOCK_SIZE, DualPoolLayout, dual_pool_layout
from hybridkv.sizing.errors import CapacityError
from hybridkv.sizing.geometry import LINEAR_ATTENTION, ModelGeometry, dtype_bytes
from hybridkv.sizing.memory import RankBytes, byte_model
from hybridkv.sizing.quantization import dequantized_weight_bytes

MIB = 1 << 20
GIB = 1 << 30
SAMPLER_BYTES_PER_LOGIT = 32  # the top-p sort's peak per logit (module docstring)
TP_COMMUNICATION_BYTES = 512 * MIB
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# Mixed and prefill steps of up to this many tokens replay their token-wise work as CUDA graphs by default
# (`hybridkv serve --piecewise-cuda-graph-max-tokens`).
DEFAULT_PIECEWISE_GRAPH_TOKENS = 2048
MAX_NUM_BATCHED_TOKENS = 1_048_576


def parse_utilization(value: object) -> Decimal:
    """`gpu_memory_utilization` as an exact Decimal in (0, 1]; CapacityError otherwise."""
    if isinstance(value, bool):
        raise CapacityError(f"gpu_memory_utilization must be a number in (0, 1], got {value!r}")
    try:
        utilization = Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise CapacityError(f"gpu_memory_utilization must be a number in (0, 1], got {value!r}") from None
    if not utilization.is_finite() or not Decimal(0) < utilization <= Decimal(1):
        raise CapacityError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
    return utilization


def requested_memory_bytes(total_memory_bytes: int, gpu_memory_utilization: object) -> int:
    """ceil(total × utilization), computed exactly: the memory an engine may use on one GPU."""
    utilization = parse_utilization(gpu_memory_utilization)
    return math.ceil(Decimal(total_memory_bytes) * utilization)


def widest_projection_per_rank(geometry: ModelGeometry, tp: int) -> int:
    """Elements per token of the widest per-layer intermediate on one rank (see the module docstring)."""
    gate_up = 2 * geometry.intermediate_size // tp
    experts = 0
    if geometry.is_moe:
        # The fused kernel's rows, one per choice (the shared expert one more when it runs in the stack): the SwiGLU
        # product (moe_intermediate / tp) and the down projection's weighted output (hidden, summed per token after).
        stacked = geometry.shared_expert_in_stack
        rows = geometry.num_experts_per_tok + stacked
        experts = (
            rows * (geometry.moe_intermediate_size // tp + geometry.hidden_size)
            + (0 if stacked else 2 * geometry.shared_expert_intermediate_size // tp)
            + 2 * geometry.num_experts  # fp32 router logits, in bf16 elements
        )
    gdn_in = (geometry.conv_dim + geometry.value_dim + 2 * geometry.linear_num_value_heads) // tp
    q_out = geometry.num_attention_heads * geometry.head_dim * (2 if geometry.attn_output_gate else 1) // tp
    kv_out = 2 * max(1, geometry.num_key_value_heads // tp) * geometry.head_dim
    return max(gate_up, experts, gdn_in, q_out + kv_out)


@dataclass(frozen=True)
class ReserveCalibration:
    """The fitted terms of the reserve estimate (`data/reserve.json`, written by bench/calibrate_reserve.py)."""

    fixed_bytes: int
    activation_bytes_per_element: Decimal
    fitted_on: tuple[str, ...]


@cache
def reserve_calibration() -> ReserveCalibration:
    raw = json.loads(resources.files("hybridkv.sizing").joinpath("data/reserve.json").read_text())
    return ReserveCalibration(
        fixed_bytes=int(raw["fixed_bytes"]),
        activation_bytes_per_element=Decimal(raw["activation_bytes_per_element"]),
        fitted_on=tuple(run["model"] for run in raw["fitted_on"]),
    )


def reserve_activation_elements(geometry: ModelGeometry, tp: int, max_num_batched_tokens: int) -> int:
    """Elements of the widest step intermediate the activation term scales with (batched tokens × width)."""
    return max_num_batched_tokens * (geometry.hidden_size + widest_projection_per_rank(geometry, tp))


def piecewise_arena_bytes(geometry: ModelGeometry, tp: int, graph_tokens: int) -> int:
    """Bytes of the buffers the piecewise graphs hand tensors on through, on one rank, at `graph_tokens` rows: piece
    i carries (residual, layer i's mixer projections) to the next, pieces alternate between two sets of buffers,
    each buffer as wide as the widest tensor its position carries in its set; the last piece carries the final
    hidden rows; one more buffer holds a token mixer's output."""
    hidden = geometry.hidden_size
    gdn = [hidden, (geometry.conv_dim + geometry.value_dim + 2 * geometry.linear_num_value_heads) // tp]
    q = geometry.num_attention_heads // tp * geometry.head_dim
    kv = max(1, geometry.num_key_value_heads // tp) * geometry.head_dim
    attention = [hidden, q, kv, kv] + ([q] if geometry.attn_output_gate else [])
    carried = [gdn if kind == LINEAR_ATTENTION else attention for kind in geometry.layer_types] + [[hidden]]
    widths: list[list[int]] = [[], []]
    for index, row in enumerate(carried):
        width = widths[index % 2]
        for position, size in enumerate(row):
            if position == len(width):
                width.append(0)
            width[position] = max(width[position], size)
    core = max(geometry.value_dim // tp, q)
    return graph_tokens * dtype_bytes(geometry.dtype) * (sum(widths[0]) + sum(widths[1]) + core)


def piecewise_graph_tokens(max_num_batched_tokens: int, limit: int = DEFAULT_PIECEWISE_GRAPH_TOKENS) -> int:
    """The largest step the piecewise graphs are captured for."""
    return min(limit, max_num_batched_tokens)


def piecewise_reserve_terms(geometry: ModelGeometry, tp: int, graph_tokens: int) -> tuple[int, int]:
    """What piecewise graphs at `graph_tokens` tokens (0: none) add to the reserve: (activation elements of their
    largest piece, counted with the fitted coefficient; exact arena bytes)."""
    if not graph_tokens:
        return 0, 0
    return reserve_activation_elements(geometry, tp, graph_tokens), piecewise_arena_bytes(geometry, tp, graph_tokens)


def reserve_unfitted_bytes(geometry: ModelGeometry, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The terms of the reserve that are not fitted: the sampler, the largest 4-bit weight a prefill step
    dequantizes and, past one GPU, NCCL buffers."""
    sampler = min(max_num_seqs, max_num_batched_tokens) * geometry.vocab_size * SAMPLER_BYTES_PER_LOGIT
    return (sampler + dequantized_weight_bytes(geometry, tp, max_num_batched_tokens)
            + (TP_COMMUNICATION_BYTES if tp > 1 else 0))


def estimate_reserve_bytes(
    geometry: ModelGeometry,
    tp: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    calibration: ReserveCalibration | None = None,
    piecewise_tokens: int | None = None,
) -> int:
    """The planner's estimate of per-rank memory besides weights and cache (formula in the module docstring).
    `piecewise_tokens`: the largest step replayed piecewise (None: the engine's default; 0: none)."""
    if not 1 <= max_num_batched_tokens <= MAX_NUM_BATCHED_TOKENS:
        raise CapacityError(
            f"max_num_batched_tokens must be in [1, {MAX_NUM_BATCHED_TOKENS}], got {max_num_batched_tokens}"
        )
    calibration = calibration or reserve_calibration()
    activations = math.ceil(
        calibration.activation_bytes_per_element * reserve_activation_elements(geometry, tp, max_num_batched_tokens)
    )
    if piecewise_tokens is None:
        piecewise_tokens = piecewise_graph_tokens(max_num_batched_tokens)
    piece_elements, arenas = piecewise_reserve_terms(geometry, tp, piecewise_tokens)
    piecewise = arenas + math.ceil(calibration.activation_bytes_per_element * piece_elements)
    return calibration.fixed_bytes + activations + piecewise + reserve_unfitted_bytes(
        geometry, tp, max_num_batched_tokens, max_num_seqs
    )


@dataclass(frozen=True)
class Prediction:
    """A capacity predicted before deployment, per rank."""

    rank_bytes: RankBytes
    requested_bytes: int  # ceil(total × utilization); equals budget + weights + reserve unless the budget was fixed
    weights_bytes: int
    reserve_bytes: int
    budget_bytes: int
    layout: DualPoolLayout

    def to_dict(self) -> dict:
        return {
            "requested_bytes": self.requested_bytes,
            "weights_bytes": self.weights_bytes,
            "reserve_bytes": self.reserve_bytes,
            "budget_bytes": self.budget_bytes,
            "bytes_per_token": self.rank_bytes.bytes_per_token,
            "bytes_per_request": self.rank_bytes.bytes_per_request,
            **self.layout.to_dict(),
        }


def predict_capacity(
    geometry: ModelGeometry,
    tp: int,
    total_memory_bytes: int,
    gpu_memory_utilization: object,
    max_num_seqs: int,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_memory_bytes: int | None = None,
    kv_dtype: str | None = None,
    ssm_dtype: str | None = None,
    checkpoint_slots: int = 0,
    piecewise_tokens: int | None = None,
) -> Prediction:
    """Predict one rank's dual-pool layout (with `checkpoint_slots` prefix-cache checkpoints). With
    `kv_cache_memory_bytes` the budget is exactly that number. `piecewise_tokens` as `estimate_reserve_bytes`."""
    rank_bytes = byte_model(geometry, tp, kv_dtype=kv_dtype, ssm_dtype=ssm_dtype)
    reserve = estimate_reserve_bytes(geometry, tp, max_num_batched_tokens, max_num_seqs,
                                     piecewise_tokens=piecewise_tokens)
    requested = requested_memory_bytes(total_memory_bytes, gpu_memory_utilization)
    if kv_cache_memory_bytes is not None:
        if isinstance(kv_cache_memory_bytes, bool) or not isinstance(kv_cache_memory_bytes, int) or (
            kv_cache_memory_bytes < 1
        ):
            raise CapacityError(f"kv_cache_memory_bytes must be a positive integer, got {kv_cache_memory_bytes!r}")
        budget = kv_cache_memory_bytes
    else:
        budget = requested - rank_bytes.weights_bytes - reserve
        if budget <= 0:
            raise CapacityError(
                f"{geometry.name} at tp={tp}: {rank_bytes.weights_bytes / GIB:.2f} GiB of weights and "
                f"{reserve / GIB:.2f} GiB of reserve per rank exceed the {requested / GIB:.2f} GiB that "
                f"gpu_memory_utilization {gpu_memory_utilization} allows; use more GPUs or a higher utilization"
            )
    layout = dual_pool_layout(rank_bytes, budget, max_num_seqs, block_size, checkpoint_slots)
    return Prediction(
        rank_bytes=rank_bytes,
        requested_bytes=requested,
        weights_bytes=rank_bytes.weights_bytes,
        reserve_bytes=reserve,
        budget_bytes=budget,
        layout=layout,
    )
