"""The planner: the fewest GPUs and the lowest gpu_memory_utilization that hold a HybridModel's target.

Target: `max_num_seqs` state slots (= `serving.maxConcurrency`, or `overrides.maxNumSeqs`) and a token target: one
full-length request at least, and `serving.targetTokens`, or by default `maxConcurrency × maxModelLen`. A default
target that fits on no allowed GPU count is capped at what the fewest GPUs hold at the highest planned utilization
(and the plan says so); an explicit target that does not fit is an error.

Search: valid tensor-parallel sizes ascending (up to `gpu.maxPerReplica`, default 8, or exactly the override), then
utilization on a 0.01 grid ascending (up to 0.95, or exactly the override); the first pair whose dual pool holds the
target with the safety margin wins. The safety margin: the target must still fit if the real reserve (activations,
graphs, context) is `1 + reserve_margin` times the estimate (default 1.5×). The plan's prediction itself uses the
estimate, so predicted capacity ≥ target, and the measured capacity can be compared with it honestly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from hybridkv.sizing.allocators import DEFAULT_BLOCK_SIZE, PoolModel, pool_models
from hybridkv.sizing.errors import CapacityError, GeometryError, GpuError, PlanError, TensorParallelError
from hybridkv.sizing.geometry import ModelGeometry, catalog_geometry, geometry_from_config, is_catalog_model
from hybridkv.sizing.gpus import GIB, GpuSpec, gpu_spec
from hybridkv.sizing.memory import byte_model, check_tensor_parallel_size, valid_tensor_parallel_sizes
from hybridkv.sizing.prediction import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    Prediction,
    estimate_reserve_bytes,
    predict_capacity,
    requested_memory_bytes,
)
from hybridkv.sizing.spec import HybridModelSpec

DEFAULT_MAX_GPUS_PER_REPLICA = 8
MAX_PLANNED_UTILIZATION_PERCENT = 95
DEFAULT_RESERVE_MARGIN = Decimal("0.5")


def format_utilization(percent: int) -> str:
    return f"{percent // 100}.{percent % 100:02d}"


def _percent(utilization: str) -> int:
    return int(Decimal(utilization) * 100)


@dataclass(frozen=True)
class Plan:
    spec_name: str
    geometry: ModelGeometry
    gpu: GpuSpec
    tensor_parallel_size: int
    gpu_memory_utilization: str
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    target_tokens: int
    target_capped: bool
    reserve_margin: Decimal
    safety_margin_bytes: int
    kv_cache_memory_bytes: int | None
    prediction: Prediction
    allocators: dict[str, PoolModel]
    reasons: tuple[str, ...]

    @property
    def layout(self):
        return self.prediction.layout

    @property
    def token_capacity(self) -> int:
        return self.prediction.layout.token_capacity

    def allocator_figures(self) -> dict[str, dict]:
        """Per allocator on the same budget: tokens with max_num_seqs / one request resident, and max concurrency."""
        figures = {}
        for key, model in self.allocators.items():
            figures[key] = {
                "label": model.label,
                "block_size": model.block_size,
                "token_capacity": model.token_capacity(self.max_num_seqs),
                "token_capacity_one_request": model.token_capacity(1),
                "max_concurrency_at_max_model_len": model.max_concurrency(self.max_model_len),
                "bytes": model.breakdown(self.max_num_seqs),
            }
        return figures

    def to_dict(self) -> dict:
        layout = self.prediction.layout
        return {
            "name": self.spec_name,
            "model": self.geometry.name,
            "gpu": {"name": self.gpu.name, "product": self.gpu.product, "memory_mib": self.gpu.memory_mib},
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpus_per_replica": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "block_size": layout.block_size,
            "bytes_per_token": self.prediction.rank_bytes.bytes_per_token,
            "bytes_per_request": self.prediction.rank_bytes.bytes_per_request,
            "weights_bytes": self.prediction.weights_bytes,
            "reserve_bytes": self.prediction.reserve_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            "reserve_margin": str(self.reserve_margin),
            "requested_bytes": self.prediction.requested_bytes,
            "budget_bytes": self.prediction.budget_bytes,
            "state_slots": layout.state_slots,
            "token_blocks": layout.token_blocks,
            "token_capacity": layout.token_capacity,
            "state_pool_bytes": layout.state_pool_bytes,
            "token_pool_bytes": layout.token_pool_bytes,
            "state_pool_usable_bytes": layout.state_pool_usable_bytes,
            "token_pool_usable_bytes": layout.token_pool_usable_bytes,
            "target_tokens": self.target_tokens,
            "target_capped": self.target_capped,
            "allocators": self.allocator_figures(),
            "reasons": list(self.reasons),
        }


# ---- resolving the model and the GPU -------------------------------------------------------------------------------
def resolve_geometry(spec: HybridModelSpec, model_config: dict | None = None) -> ModelGeometry:
    """The geometry from the inline config, a resolved ConfigMap (`model_config`), or the catalog."""
    if spec.model.config is not None:
        return spec.inline_geometry()
    if model_config is not None:
        try:
            return geometry_from_config(model_config, name=spec.model.name)
        except GeometryError as exc:
            raise PlanError(f"model config of {spec.model.name}: {exc}") from None
    if spec.model.config_map_ref is not None:
        raise PlanError(
            f"spec.model.configMapRef {spec.model.config_map_ref.name!r} must be read before planning; "
            "pass its config.json (hybridkv plan --model-config FILE)"
        )
    if not is_catalog_model(spec.model.name):
        try:
            catalog_geometry(spec.model.name)
        except GeometryError as exc:
            raise PlanError(f"{exc}; set spec.model.config or spec.model.configMapRef for other models") from None
    return catalog_geometry(spec.model.name)


def resolve_gpu(spec: HybridModelSpec, gpu: GpuSpec | None = None) -> GpuSpec:
    """The caller's GPU (from node labels) wins; then spec.gpu.memoryMiB (with its product), then spec.gpu.product."""
    if gpu is not None:
        return gpu
    product, memory_mib = spec.gpu.product, spec.gpu.memory_mib
    if memory_mib is not None:
        return GpuSpec.from_memory_mib(memory_mib, product or "")
    if product is not None:
        try:
            return gpu_spec(product)
        except GpuError as exc:
            raise GpuError(f"spec.gpu.product: {exc} (spec.gpu.memoryMiB)") from None
    raise PlanError("no GPU to plan for: set spec.gpu.product or spec.gpu.memoryMiB (or pass --gpu)")


# ---- the search ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Candidate:
    tp: int
    percent: int
    prediction: Prediction | None
    tokens_with_margin: int  # token capacity if the reserve is (1 + margin) × the estimate; 0 if nothing fits


class _Search:
    def __init__(self, geometry, gpu, max_num_seqs, max_num_batched_tokens, block_size, kv_cache_memory_bytes,
                 reserve_margin):
        self.geometry = geometry
        self.gpu = gpu
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.reserve_margin = reserve_margin

    def margin_bytes(self, tp: int) -> int:
        reserve = estimate_reserve_bytes(self.geometry, tp, self.max_num_batched_tokens, self.max_num_seqs)
        return math.ceil(reserve * self.reserve_margin)

    def evaluate(self, tp: int, percent: int) -> _Candidate:
        utilization = format_utilization(percent)
        try:
            prediction = predict_capacity(
                self.geometry, tp, self.gpu.memory_bytes, utilization, self.max_num_seqs,
                self.max_num_batched_tokens, self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            )
        except CapacityError:
            return _Candidate(tp, percent, None, 0)
        margin = self.margin_bytes(tp)
        free = prediction.requested_bytes - prediction.weights_bytes - prediction.reserve_bytes - margin
        if self.kv_cache_memory_bytes is not None:
            # A fixed budget must still fit beside weights, reserve and margin.
            budget_with_margin = prediction.budget_bytes if free >= prediction.budget_bytes else 0
        else:
            budget_with_margin = free
        rank = prediction.rank_bytes
        block_bytes = self.block_size * rank.bytes_per_token
        blocks = (budget_with_margin - (self.max_num_seqs + 1) * rank.bytes_per_request) // block_bytes - 1
        return _Candidate(tp, percent, prediction, max(0, blocks) * self.block_size)

    def lowest(self, tp: int, percents: list[int], target_tokens: int) -> _Candidate | None:
        """The lowest utilization at which `tp` holds the target with margin (capacity is monotone: bisect)."""
        low, high = 0, len(percents)
        while low < high:
            middle = (low + high) // 2
            if self.evaluate(tp, percents[middle]).tokens_with_margin >= target_tokens:
                high = middle
            else:
                low = middle + 1
        return self.evaluate(tp, percents[low]) if low < len(percents) else None


def plan(
    spec: HybridModelSpec,
    gpu: GpuSpec | None = None,
    *,
    model_config: dict | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    reserve_margin: Decimal | str | float = DEFAULT_RESERVE_MARGIN,
) -> Plan:
    """Plan a HybridModel on `gpu` (default: from spec.gpu); PlanError says why no plan exists."""
    geometry = resolve_geometry(spec, model_config)
    gpu = resolve_gpu(spec, gpu)
    try:
        reserve_margin = Decimal(str(reserve_margin))
    except InvalidOperation:
        raise PlanError(f"the reserve margin must be a number in [0, 10], got {reserve_margin!r}") from None
    if not Decimal(0) <= reserve_margin <= Decimal(10):
        raise PlanError(f"the reserve margin must be a number in [0, 10], got {reserve_margin}")
    if kv_cache_memory_bytes is not None and (
        isinstance(kv_cache_memory_bytes, bool) or not isinstance(kv_cache_memory_bytes, int)
        or kv_cache_memory_bytes < 1
    ):
        raise PlanError(f"the cache memory must be a positive number of bytes, got {kv_cache_memory_bytes!r}")
    if not 1 <= max_num_batched_tokens <= MAX_NUM_BATCHED_TOKENS:
        raise PlanError(
            f"max_num_batched_tokens must be in [1, {MAX_NUM_BATCHED_TOKENS}], got {max_num_batched_tokens}"
        )
    serving, overrides = spec.serving, spec.overrides
    if serving.max_model_len > geometry.max_position_embeddings:
        raise PlanError(
            f"serving.maxModelLen {serving.max_model_len} exceeds {geometry.name}'s "
            f"max_position_embeddings {geometry.max_position_embeddings}"
        )
    max_num_seqs = overrides.max_num_seqs or serving.max_concurrency
    reasons = []
    if overrides.tensor_parallel_size is not None:
        try:
            check_tensor_parallel_size(geometry, overrides.tensor_parallel_size)
        except TensorParallelError as exc:
            raise PlanError(f"overrides.tensorParallelSize: {exc}") from None
        tps = [overrides.tensor_parallel_size]
        reasons.append(f"tensor_parallel_size {tps[0]} is set by overrides.tensorParallelSize")
        tp_limit = f"overrides.tensorParallelSize is {tps[0]}"
    else:
        max_gpus = spec.gpu.max_per_replica or DEFAULT_MAX_GPUS_PER_REPLICA
        tps = valid_tensor_parallel_sizes(geometry, max_gpus)
        tp_limit = (
            f"gpu.maxPerReplica allows {max_gpus}" if spec.gpu.max_per_replica
            else f"plans use at most {max_gpus} GPUs per replica unless gpu.maxPerReplica says otherwise"
        )
        if not tps:
            raise PlanError(f"{geometry.name} has no valid tensor-parallel size up to {max_gpus}")
    if overrides.gpu_memory_utilization is not None:
        percents = [_percent(overrides.gpu_memory_utilization)]
        reasons.append(f"gpu_memory_utilization {overrides.gpu_memory_utilization} is set by overrides")
    else:
        percents = list(range(1, MAX_PLANNED_UTILIZATION_PERCENT + 1))
    search = _Search(geometry, gpu, max_num_seqs, max_num_batched_tokens, block_size, kv_cache_memory_bytes,
                     reserve_margin)

    explicit_target = serving.target_tokens is not None
    wanted = serving.target_tokens if explicit_target else serving.max_concurrency * serving.max_model_len
    target = max(wanted, serving.max_model_len)
    capped = False
    chosen = next((c for tp in tps if (c := search.lowest(tp, percents, target)) is not None), None)
    if chosen is None and not explicit_target:
        # Default target: the most the fewest GPUs hold, as long as one full-length request fits.
        fitting = next(
            (c for tp in tps if (c := search.evaluate(tp, percents[-1])).tokens_with_margin >= serving.max_model_len),
            None,
        )
        if fitting is not None:
            chosen = search.lowest(fitting.tp, percents, fitting.tokens_with_margin)
            target, capped = fitting.tokens_with_margin, True
    if chosen is None:
        raise PlanError(_no_plan_reason(search, geometry, gpu, tps, percents, target, tp_limit, explicit_target))

    tp, utilization = chosen.tp, format_utilization(chosen.percent)
    prediction = chosen.prediction
    if overrides.tensor_parallel_size is None:
        smaller = [t for t in tps if t < tp]
        reasons.append(
            f"tensor_parallel_size {tp}: the smallest valid tp that holds the target"
            + (f" (tp {', '.join(map(str, smaller))} cannot)" if smaller else "")
        )
    if overrides.gpu_memory_utilization is None:
        reasons.append(
            f"gpu_memory_utilization {utilization}: the lowest on a 0.01 grid that holds {target:,} tokens "
            f"even if the reserve is {1 + reserve_margin}× the {prediction.reserve_bytes / GIB:.2f} GiB estimate"
        )
    if capped:
        reasons.append(
            f"maxConcurrency × maxModelLen = {wanted:,} tokens does not fit on up to {tps[-1]} GPU(s); the target "
            f"is capped at the {target:,} tokens {tp} GPU(s) hold; set serving.targetTokens to require a figure"
        )
    reasons.append(f"max_num_seqs {max_num_seqs}: " + (
        "set by overrides.maxNumSeqs" if overrides.max_num_seqs else "serving.maxConcurrency, one state slot each"
    ))
    return Plan(
        spec_name=spec.name,
        geometry=geometry,
        gpu=gpu,
        tensor_parallel_size=tp,
        gpu_memory_utilization=utilization,
        max_num_seqs=max_num_seqs,
        max_model_len=serving.max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        target_tokens=target,
        target_capped=capped,
        reserve_margin=reserve_margin,
        safety_margin_bytes=search.margin_bytes(tp),
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        prediction=prediction,
        allocators=pool_models(prediction.rank_bytes, prediction.budget_bytes, max_num_seqs, block_size),
        reasons=tuple(reasons),
    )


def _no_plan_reason(search: _Search, geometry, gpu, tps, percents, target, tp_limit, explicit_target) -> str:
    """The most specific reason no allowed (tp, utilization) holds the target."""
    gpu_gib = gpu.memory_bytes / GIB
    gpu_name = gpu.display_name
    top_percent = percents[-1]
    usable = requested_memory_bytes(gpu.memory_bytes, format_utilization(top_percent))

    def fits_on_gpu(tp: int) -> bool:
        return search.evaluate(tp, top_percent).tokens_with_margin >= target

    beyond = [tp for tp in valid_tensor_parallel_sizes(geometry, 64) if tp > tps[-1] and fits_on_gpu(tp)]
    advice = (f"the smallest valid tp that fits on {gpu_name} is {beyond[0]}" if beyond
              else f"no valid tp fits on {gpu_name}")
    first = tps[0]
    weights = byte_model(geometry, first).weights_bytes
    overhead = estimate_reserve_bytes(geometry, first, search.max_num_batched_tokens, search.max_num_seqs)
    overhead += search.margin_bytes(first)
    article = "an" if gpu_name[:1] in "AEFHILMNORSX" else "a"
    if weights >= usable:
        return (
            f"{geometry.name} needs {weights / GIB:.1f} GiB of text-model weights at tp={first}; "
            f"{article} {gpu_name} has {gpu_gib:.1f} GiB; {advice}; {tp_limit}"
        )
    if weights + overhead >= usable:
        return (
            f"{geometry.name} needs {weights / GIB:.1f} GiB of text-model weights and {overhead / GIB:.1f} GiB of "
            f"reserve and safety margin at tp={first}; at utilization {format_utilization(top_percent)} "
            f"{article} {gpu_name} gives {usable / GIB:.1f} GiB; {advice}; {tp_limit}"
        )
    last = search.evaluate(tps[-1], top_percent)
    rank = byte_model(geometry, tps[-1])
    state_gib = (search.max_num_seqs + 1) * rank.bytes_per_request / GIB
    what = "serving.targetTokens" if explicit_target else "serving.maxModelLen"
    return (
        f"{geometry.name} on {gpu_name}: at tp={tps[-1]} and utilization {format_utilization(top_percent)} the "
        f"cache holds {search.max_num_seqs} state slots ({state_gib:.1f} GiB) and {last.tokens_with_margin:,} "
        f"tokens with the safety margin, short of the {target:,} required by {what}; lower "
        f"serving.maxConcurrency or {what}, or allow more GPUs ({advice}; {tp_limit})"
    )

