"""The planner: the fewest GPUs, and the utilization the GPUs allow, whose dual pool holds what the spec asks for.

What must fit (one of, checked with the reserve at `1 + reserve_margin` times its estimate, default 1.5×):
- `serving.targetTokens`: that many attention tokens (at least one full-length request);
- `serving.guaranteeFullLength`: every one of `max_num_seqs` requests at `maxModelLen` at once;
- `serving.workload`: the workload replayed with every request queued (so `max_num_seqs` run whenever the pools
  allow) preempts at most `maxPreemptionRate` per request and refuses none (`hybridkv.sizing.workload`);
- otherwise what vLLM itself requires: `max_num_seqs` state slots and one request at `maxModelLen`. The plan then
  says what that holds (full-length requests at once; the mean length at which all `max_num_seqs` fit) and shows
  the full-length guarantee as an alternative with its GPU count.

Utilization: a replica gets whole GPUs, so the cache gets the memory paid for: the highest utilization on a 0.01 grid,
at most 0.95, that leaves the safety margin (`reserve_margin` × the reserve estimate) outside the engine. Only when
`spec.gpu.shared` says the GPU is shared (MIG, time-slicing) is it the lowest utilization that holds the requirement;
`overrides.gpuMemoryUtilization` fixes it. Tensor-parallel sizes are tried ascending (up to `gpu.maxPerReplica`,
default 8, or exactly the override); the first that holds the requirement wins. When none does, the message names
the constraint that stops it and the smallest change that would make a plan exist.

Prefix caching's checkpoint pool: `serving.prefixCaching.checkpointSlots` when given; else, when
`serving.workload.conversations` describes the chats, the fewest slots that replaying them finds enough
(`hybridkv.sizing.workload.size_checkpoint_slots`); else DEFAULT_CHECKPOINT_FRACTION of `max_num_seqs`.
"""


from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from hybridkv.sizing.allocators import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_VLLM_CUDA_MAJOR,
    DUAL_POOL,
    DEFAULT_CHECKPOINT_FRACTION,
    PoolModel,
    default_checkpoint_slots,
    pool_model,
    pool_models,
    readable_bytes,
)
from hybridkv.sizing.errors import (
    CapacityError,
    GeometryError,
    GpuError,
    PlanError,
    TensorParallelError,
    UnknownModelError,
)
from hybridkv.sizing.geometry import ModelGeometry, catalog_geometry, geometry_from_config, is_catalog_model
from hybridkv.sizing.quantization import with_checkpoint_bytes
from hybridkv.sizing.gpus import GIB, GpuSpec, gpu_spec
from hybridkv.sizing.memory import MAX_TENSOR_PARALLEL_SIZE, RankBytes, byte_model, check_tensor_parallel_size
from hybridkv.sizing.memory import kv_cache_dtype, valid_tensor_parallel_sizes
from hybridkv.sizing.prediction import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    Prediction,
    estimate_reserve_bytes,
    predict_capacity,
    requested_memory_bytes,
)
from hybridkv.sizing.simulate import TraceRequest
from hybridkv.sizing.spec import HybridModelSpec
from hybridkv.sizing.workload import (
    CHECKPOINT_SIZING_FRACTION,
    CheckpointSizing,
    WorkloadCheck,
    check_workload,
    describe_workload,
    size_checkpoint_slots,
    workload_requests,
)

DEFAULT_MAX_GPUS_PER_REPLICA = 8
MAX_PLANNED_UTILIZATION_PERCENT = 95
DEFAULT_RESERVE_MARGIN = Decimal("0.5")
# What the cache must hold (Plan.requirement).
REQUIRE_DEFAULT, REQUIRE_TARGET, REQUIRE_FULL_LENGTH, REQUIRE_WORKLOAD = "vllm-minimum", "target", "full-length", "workload"


def format_utilization(percent: int) -> str:
    return f"{percent // 100}.{percent % 100:02d}"


def _percent(utilization: str) -> int:
    return int(Decimal(utilization) * 100)


def full_length_requests(token_capacity: int, max_model_len: int, block_size: int, max_num_seqs: int) -> int:
    """Requests at maxModelLen a token pool of this capacity holds at once (at most max_num_seqs)."""
    return min(max_num_seqs, token_capacity // (-(-max_model_len // block_size) * block_size))


def mean_tokens_all_running(token_capacity: int, max_model_len: int, max_num_seqs: int) -> int:
    """The mean request length (prompt + output) at which all max_num_seqs requests fit at once."""
    return min(max_model_len, token_capacity // max_num_seqs)


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
    requirement: str  # REQUIRE_*: what the cache was sized to hold
    target_tokens: int  # attention tokens the plan had to hold (with the safety margin)
    reserve_margin: Decimal
    safety_margin_bytes: int
    kv_cache_memory_bytes: int | None
    kv_cache_dtype: str  # the choice the engine is started with (`--kv-cache-dtype`): auto or fp8
    prediction: Prediction
    vllm_budget_bytes: int  # the budget vLLM's columns get: the same memory less the vision tower vLLM loads
    allocators: dict[str, PoolModel]
    alternatives: tuple[dict, ...]
    state_dtypes: dict  # token capacity with the recurrent state in float32 and in bfloat16, same GPUs and memory
    workload: dict | None
    reasons: tuple[str, ...]
    prefix_caching: bool = False
    checkpoint_interval_tokens: int = 0  # with prefix caching: long prompts are also checkpointed this often
    checkpoint_sizing: dict | None = None  # the replay that sized the checkpoint pool from the workload's chats

    @property
    def layout(self):
        return self.prediction.layout

    @property
    def token_capacity(self) -> int:
        return self.prediction.layout.token_capacity

    @property
    def full_length_requests(self) -> int:
        return full_length_requests(self.token_capacity, self.max_model_len, self.layout.block_size,
                                    self.max_num_seqs)

    @property
    def mean_tokens_all_running(self) -> int:
        return mean_tokens_all_running(self.token_capacity, self.max_model_len, self.max_num_seqs)

    def allocator_figures(self) -> dict[str, dict]:
        """Per allocator: tokens with max_num_seqs / one request resident, max concurrency, vLLM's start-up log."""
        figures = {}
        for key, model in self.allocators.items():
            figures[key] = {
                "label": model.label,
                "rule": model.allocator.rule,
                "budget_bytes": model.budget_bytes,
                "block_size": model.block_size,
                "token_capacity": model.token_capacity(self.max_num_seqs),
                "token_capacity_one_request": model.token_capacity(1),
                "max_concurrency_at_max_model_len": model.max_concurrency(self.max_model_len),
                "vllm_startup_log": model.vllm_startup_log(self.max_model_len),
                "bytes": model.breakdown(self.max_num_seqs),
            }
        return figures

    def to_dict(self) -> dict:
        layout = self.prediction.layout
        rank = self.prediction.rank_bytes
        return {
            "name": self.spec_name,
            "model": self.geometry.name,
            "gpu": {"name": self.gpu.name, "product": self.gpu.product, "memory_mib": self.gpu.memory_mib,
                    "compute_capability": self.gpu.compute_capability_text},
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpus_per_replica": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "block_size": layout.block_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_dtype": rank.kv_dtype,
            "conv_state_dtype": rank.conv_dtype,
            "ssm_state_dtype": rank.ssm_dtype,
            "bytes_per_token": rank.bytes_per_token,
            "bytes_per_request": rank.bytes_per_request,
            "weights_bytes": self.prediction.weights_bytes,
            "vision_weights_bytes_skipped": self.geometry.vision_weights_bytes(self.tensor_parallel_size),
            "reserve_bytes": self.prediction.reserve_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            "reserve_margin": str(self.reserve_margin),
            "requested_bytes": self.prediction.requested_bytes,
            "budget_bytes": self.prediction.budget_bytes,
            "vllm_budget_bytes": self.vllm_budget_bytes,
            "state_slots": layout.state_slots,
            "token_blocks": layout.token_blocks,
            "token_capacity": layout.token_capacity,
            "state_pool_bytes": layout.state_pool_bytes,
            "token_pool_bytes": layout.token_pool_bytes,
            "state_pool_usable_bytes": layout.state_pool_usable_bytes,
            "token_pool_usable_bytes": layout.token_pool_usable_bytes,
            "prefix_caching": self.prefix_caching,
            "checkpoint_slots": layout.checkpoint_slots,
            "checkpoint_pool_bytes": layout.checkpoint_pool_bytes,
            "checkpoint_attention_tokens": layout.checkpoint_attention_tokens,
            "checkpoint_interval_tokens": self.checkpoint_interval_tokens,
            "checkpoint_sizing": self.checkpoint_sizing,
            "requirement": self.requirement,
            "target_tokens": self.target_tokens,
            "full_length_requests": self.full_length_requests,
            "mean_tokens_all_running": self.mean_tokens_all_running,
            "state_dtypes": self.state_dtypes,
            "workload": self.workload,
            "alternatives": list(self.alternatives),
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
        except UnknownModelError as exc:
            raise UnknownModelError(
                f"{exc}; set spec.model.config or spec.model.configMapRef for other models"
            ) from None
    return catalog_geometry(spec.model.name)


def resolve_gpu(spec: HybridModelSpec, gpu: GpuSpec | None = None) -> GpuSpec:
    """The caller's GPU (from node labels) wins; then spec.gpu.memoryMiB (with its product), then spec.gpu.product.

    spec.gpu.computeCapability, when set, states the architecture of a GPU the catalog does not know.
    """
    return _resolve_gpu_memory(spec, gpu).with_compute_capability(spec.gpu.compute_capability)


def _resolve_gpu_memory(spec: HybridModelSpec, gpu: GpuSpec | None) -> GpuSpec:
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
    margin_budget_bytes: int  # the cache budget left if the reserve is (1 + margin) × the estimate
    workload: WorkloadCheck | None = None


class _Search:
    """Evaluates (tp, utilization) pairs against one requirement."""

    def __init__(self, geometry, gpu, max_num_seqs, max_num_batched_tokens, block_size, kv_cache_memory_bytes,
                 reserve_margin, ssm_dtype, kv_dtype, max_model_len, target_tokens, requests=None,
                 max_preemption_rate=0.0, checkpoint_slots=0):
        self.geometry = geometry
        self.gpu = gpu
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.reserve_margin = reserve_margin
        self.ssm_dtype = ssm_dtype
        self.kv_dtype = kv_dtype
        self.max_model_len = max_model_len
        self.target_tokens = target_tokens
        self.requests = requests
        self.max_preemption_rate = max_preemption_rate
        self.checkpoint_slots = checkpoint_slots

    def with_target(self, target_tokens: int, max_num_seqs: int | None = None, ssm_dtype: str | None = None):
        """The same search for another token target (no workload), slot count or state dtype."""
        return _Search(self.geometry, self.gpu, max_num_seqs or self.max_num_seqs, self.max_num_batched_tokens,
                       self.block_size, self.kv_cache_memory_bytes, self.reserve_margin, ssm_dtype or self.ssm_dtype,
                       self.kv_dtype, self.max_model_len, target_tokens, checkpoint_slots=self.checkpoint_slots)

    def rank(self, tp: int) -> RankBytes:
        return byte_model(self.geometry, tp, kv_dtype=self.kv_dtype, ssm_dtype=self.ssm_dtype)

    def reserve_bytes(self, tp: int) -> int:
        return estimate_reserve_bytes(self.geometry, tp, self.max_num_batched_tokens, self.max_num_seqs)

    def margin_bytes(self, tp: int) -> int:
        return math.ceil(self.reserve_bytes(tp) * self.reserve_margin)

    def whole_gpu_percent(self, tp: int) -> int:
        """The highest utilization (percent, ≤ 0.95) that leaves the safety margin outside the engine."""
        total = self.gpu.memory_bytes
        return max(1, min(MAX_PLANNED_UTILIZATION_PERCENT, (total - self.margin_bytes(tp)) * 100 // total))

    def tokens_for_slots(self, rank: RankBytes, budget_bytes: int, slots: int) -> int:
        block_bytes = self.block_size * rank.bytes_per_token
        state_bytes = (slots + 1 + self.checkpoint_slots) * rank.bytes_per_request
        blocks = (budget_bytes - state_bytes) // block_bytes - 1
        return max(0, blocks) * self.block_size

    def evaluate(self, tp: int, percent: int) -> _Candidate:
        utilization = format_utilization(percent)
        requested = requested_memory_bytes(self.gpu.memory_bytes, utilization)
        rank = self.rank(tp)
        free = requested - rank.weights_bytes - self.reserve_bytes(tp) - self.margin_bytes(tp)
        if self.kv_cache_memory_bytes is not None:
            # A fixed budget must still fit beside weights, reserve and margin.
            budget = self.kv_cache_memory_bytes if free >= self.kv_cache_memory_bytes else 0
        else:
            budget = max(0, free)
        try:
            prediction = predict_capacity(
                self.geometry, tp, self.gpu.memory_bytes, utilization, self.max_num_seqs,
                self.max_num_batched_tokens, self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                kv_dtype=self.kv_dtype, ssm_dtype=self.ssm_dtype, checkpoint_slots=self.checkpoint_slots,
            )
        except CapacityError:
            return _Candidate(tp, percent, None, 0, budget)
        tokens = self.tokens_for_slots(rank, budget, self.max_num_seqs)
        workload = None
        if self.requests is not None and tokens >= self.max_model_len:
            pool = pool_model(DUAL_POOL, rank, budget, self.max_num_seqs, self.block_size, self.checkpoint_slots)
            workload = check_workload(pool, self.requests, self.max_model_len, self.max_preemption_rate)
        return _Candidate(tp, percent, prediction, tokens, budget, workload)

    def holds(self, candidate: _Candidate) -> bool:
        if candidate.prediction is None or candidate.tokens_with_margin < self.target_tokens:
            return False
        return self.requests is None or (candidate.workload is not None and candidate.workload.holds)

    def lowest(self, tp: int, percents: list[int]) -> _Candidate | None:
        """The lowest utilization at which `tp` holds the requirement (capacity grows with memory: bisect)."""
        low, high = 0, len(percents)
        while low < high:
            middle = (low + high) // 2
            if self.holds(self.evaluate(tp, percents[middle])):
                high = middle
            else:
                low = middle + 1
        return self.evaluate(tp, percents[low]) if low < len(percents) else None


@dataclass(frozen=True)
class _Policy:
    """How utilization is chosen: fixed by an override, lowest (a shared GPU) or highest (whole GPUs)."""

    override_percent: int | None
    shared: bool

    def percents(self, search: _Search, tp: int) -> list[int]:
        if self.override_percent is not None:
            return [self.override_percent]
        if self.shared:
            return list(range(1, MAX_PLANNED_UTILIZATION_PERCENT + 1))
        return [search.whole_gpu_percent(tp)]

    def top_percent(self, search: _Search, tp: int) -> int:
        return self.percents(search, tp)[-1]

    def best(self, search: _Search, tp: int) -> _Candidate | None:
        percents = self.percents(search, tp)
        if len(percents) > 1:
            return search.lowest(tp, percents)
        candidate = search.evaluate(tp, percents[0])
        return candidate if search.holds(candidate) else None

    def first(self, search: _Search, tps: list[int]) -> _Candidate | None:
        return next((c for tp in tps if (c := self.best(search, tp)) is not None), None)


def _requirement_text(requirement: str, target: int, max_num_seqs: int, max_model_len: int) -> str:
    return {
        REQUIRE_TARGET: f"the {target:,} tokens of serving.targetTokens",
        REQUIRE_FULL_LENGTH: f"{max_num_seqs} requests at the full {max_model_len:,} tokens at once "
                             f"(serving.guaranteeFullLength, {target:,} tokens)",
        REQUIRE_WORKLOAD: "serving.workload within its preemption rate",
        REQUIRE_DEFAULT: f"{max_num_seqs} state slots and one {max_model_len:,}-token request (what vLLM requires)",
    }[requirement]


def plan(
    spec: HybridModelSpec,
    gpu: GpuSpec | None = None,
    *,
    model_config: dict | None = None,
    workload_trace: list[TraceRequest] | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    reserve_margin: Decimal | str | float = DEFAULT_RESERVE_MARGIN,
    vllm_cuda_major: int = DEFAULT_VLLM_CUDA_MAJOR,
    checkpoint_folder: str | None = None,
) -> Plan:
    """Plan a HybridModel on `gpu` (default: from spec.gpu); PlanError says why no plan exists and what would help.
    With `checkpoint_folder`, the weights are counted from its safetensors headers, to the byte."""
    geometry = resolve_geometry(spec, model_config)
    if checkpoint_folder is not None:
        geometry = with_checkpoint_bytes(geometry, checkpoint_folder)
    gpu = resolve_gpu(spec, gpu)
    try:
        reserve_margin = Decimal(str(reserve_margin))
    except InvalidOperation:
        raise PlanError(f"the reserve margin must be a number in [0, 10], got {reserve_margin!r}") from None
    if not reserve_margin.is_finite() or not Decimal(0) <= reserve_margin <= Decimal(10):
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
    ssm_dtype = serving.ssm_state_dtype or geometry.default_ssm_dtype
    kv_dtype = kv_cache_dtype(serving.kv_cache_dtype, geometry.dtype)
    reasons = []
    if overrides.tensor_parallel_size is not None:
        try:
            check_tensor_parallel_size(geometry, overrides.tensor_parallel_size)
        except TensorParallelError as exc:
            raise TensorParallelError(f"overrides.tensorParallelSize: {exc}") from None
        limit = spec.gpu.max_per_replica
        if limit is not None and overrides.tensor_parallel_size > limit:
            raise TensorParallelError(
                f"overrides.tensorParallelSize {overrides.tensor_parallel_size} needs that many GPUs per replica but "
                f"gpu.maxPerReplica allows {limit}; drop one or make them agree"
            )
        tps = [overrides.tensor_parallel_size]
        reasons.append(f"tensor_parallel_size {tps[0]} is set by overrides.tensorParallelSize")
        tp_limit = "overrides.tensorParallelSize"
    else:
        max_gpus = spec.gpu.max_per_replica or DEFAULT_MAX_GPUS_PER_REPLICA
        tps = valid_tensor_parallel_sizes(geometry, max_gpus)
        tp_limit = "gpu.maxPerReplica"
        if not tps:
            valid = ", ".join(map(str, valid_tensor_parallel_sizes(geometry, MAX_TENSOR_PARALLEL_SIZE)))
            raise TensorParallelError(
                f"{geometry.name} has no valid tensor-parallel size up to gpu.maxPerReplica {max_gpus}; valid: {valid}"
            )
    policy = _Policy(
        override_percent=None if overrides.gpu_memory_utilization is None
        else _percent(overrides.gpu_memory_utilization),
        shared=spec.gpu.shared,
    )
    lengths = -(-serving.max_model_len // block_size) * block_size
    requests = None
    workload = serving.workload
    if serving.target_tokens is not None:
        requirement, target = REQUIRE_TARGET, max(serving.target_tokens, serving.max_model_len)
    elif serving.guarantee_full_length:
        requirement, target = REQUIRE_FULL_LENGTH, max_num_seqs * lengths
    elif workload is not None:
        requirement, target = REQUIRE_WORKLOAD, serving.max_model_len
        requests = workload_requests(workload, serving.max_model_len, max_num_seqs, workload_trace)
    else:
        requirement, target = REQUIRE_DEFAULT, serving.max_model_len
    prefix = serving.prefix_caching
    checkpoint_slots, sizing = 0, None
    if prefix.enabled:
        checkpoint_slots = prefix.checkpoint_slots or default_checkpoint_slots(max_num_seqs)
        if prefix.checkpoint_slots is None and workload is not None and workload.conversations is not None:
            sizing = size_checkpoint_slots(workload, byte_model(geometry, 1, kv_dtype=kv_dtype, ssm_dtype=ssm_dtype),
                                           serving.max_model_len, serving.max_concurrency, block_size,
                                           prefix.checkpoint_interval_tokens)
            checkpoint_slots = sizing.slots
    search = _Search(geometry, gpu, max_num_seqs, max_num_batched_tokens, block_size, kv_cache_memory_bytes,
                     reserve_margin, ssm_dtype, kv_dtype, serving.max_model_len, target, requests,
                     0.0 if workload is None else float(workload.max_preemption_rate), checkpoint_slots)
    if kv_cache_memory_bytes is not None:
        _check_fixed_budget(search, policy, tps)
    chosen = policy.first(search, tps)
    if chosen is None:
        raise PlanError(_no_plan_reason(search, policy, tps, tp_limit, requirement))

    tp, utilization, prediction = chosen.tp, format_utilization(chosen.percent), chosen.prediction
    what = _requirement_text(requirement, target, max_num_seqs, serving.max_model_len)
    if overrides.tensor_parallel_size is None:
        smaller = [t for t in tps if t < tp]
        reasons.append(
            f"tensor_parallel_size {tp}: the fewest GPUs that hold {what}"
            + (f" (tp {', '.join(map(str, smaller))} cannot)" if smaller else "")
        )
    margin_gib = search.margin_bytes(tp) / GIB
    if policy.override_percent is not None:
        reasons.append(f"gpu_memory_utilization {utilization} is set by overrides.gpuMemoryUtilization")
    elif policy.shared:
        reasons.append(
            f"gpu_memory_utilization {utilization}: spec.gpu.shared says the GPU is shared, so the lowest on a 0.01 "
            f"grid that holds it even if the reserve is {1 + reserve_margin}× the "
            f"{prediction.reserve_bytes / GIB:.2f} GiB estimate"
        )
    else:
        outside = (gpu.memory_bytes - prediction.requested_bytes) / GIB
        reasons.append(
            f"gpu_memory_utilization {utilization}: a replica gets whole GPUs, so the cache gets the memory paid for: "
            f"the highest on a 0.01 grid (at most 0.{MAX_PLANNED_UTILIZATION_PERCENT}) that leaves the "
            f"{margin_gib:.2f} GiB safety margin ({reserve_margin} × the {prediction.reserve_bytes / GIB:.2f} GiB "
            f"reserve estimate) outside the engine ({outside:.2f} GiB is); set spec.gpu.shared for the lowest that fits"
        )
    plan_workload = None
    if chosen.workload is not None:
        check = chosen.workload
        plan_workload = {"description": describe_workload(workload, requests), **check.to_dict()}
        reasons.append(
            f"serving.workload: {plan_workload['description']}, all queued at once: on {tp} GPU(s) at "
            f"{utilization} the dual pool keeps up to {check.result.peak_concurrency} running and preempts "
            f"{check.preemption_rate:.2%} of requests (allowed {check.max_preemption_rate:.2%}) with the safety margin"
        )
    slots_gib = prediction.layout.state_pool_bytes / GIB
    capacity = prediction.layout.token_capacity
    full_length = full_length_requests(capacity, serving.max_model_len, block_size, max_num_seqs)
    mean_tokens = mean_tokens_all_running(capacity, serving.max_model_len, max_num_seqs)
    reasons.append(
        f"it holds {capacity:,} tokens beside {max_num_seqs} state slots ({slots_gib:.2f} GiB): {full_length} "
        f"request(s) at the full {serving.max_model_len:,} tokens at once, or all {max_num_seqs} at a mean of "
        f"{mean_tokens:,} tokens"
    )
    if prefix.enabled:
        reasons.append(_checkpoint_reason(prediction.layout, prefix.checkpoint_slots is not None, max_num_seqs,
                                          prefix.checkpoint_interval_tokens, workload is not None, sizing))
    alternatives = []
    if requirement != REQUIRE_FULL_LENGTH:
        alternatives.append(_full_length_alternative(search, policy, tps, max_num_seqs * lengths, tp_limit))
        guarantee = alternatives[-1]
        reasons.append(
            f"holding all {max_num_seqs} at {serving.max_model_len:,} tokens at once (serving.guaranteeFullLength) "
            + (f"takes {guarantee['tensor_parallel_size']} × {gpu.display_name} at {guarantee['gpu_memory_utilization']}"
               + ("" if guarantee["within_limit"] else f", beyond {tp_limit}") if guarantee["fits"]
               else f"fits on no valid tp up to {MAX_TENSOR_PARALLEL_SIZE} {gpu.display_name}s")
        )
    state_dtypes = _state_dtype_capacities(search, tp, chosen.percent)
    if geometry.vision is not None:
        reasons.append(
            f"{geometry.name} is a vision-language checkpoint: vLLM loads and profiles its vision tower "
            f"({geometry.vision_weights_bytes(tp) / GIB:.2f} GiB per rank), counted in the vLLM columns; "
            "hybridkv's engine serves text and skips it"
        )
    rank = prediction.rank_bytes
    other = {"float32": "bfloat16"}.get(rank.ssm_dtype, "float32")
    if other in state_dtypes and rank.ssm_dtype in state_dtypes:
        gain = state_dtypes["bfloat16"] - state_dtypes["float32"]
        reasons.append(
            f"recurrent state {rank.ssm_dtype}" + (" (the model's config)" if serving.ssm_state_dtype is None
                                                   else " (serving.ssmStateDtype)")
            + f": a bfloat16 state holds {gain:+,} tokens against float32 "
            f"({state_dtypes['float32']:,} → {state_dtypes['bfloat16']:,})"
        )
    if serving.kv_cache_dtype != "auto":
        model_dtype_bytes = byte_model(geometry, tp, ssm_dtype=ssm_dtype).bytes_per_token
        reasons.append(
            f"KV cache {rank.kv_dtype} (serving.kvCacheDtype {serving.kv_cache_dtype}): {rank.bytes_per_token:,} B "
            f"per token against {model_dtype_bytes:,} B in {geometry.dtype}, with one K and one V scale per layer "
            "from the checkpoint (1.0 where it has none)"
        )
    reasons.append(f"max_num_seqs {max_num_seqs}: " + (
        "set by overrides.maxNumSeqs" if overrides.max_num_seqs else "serving.maxConcurrency, one state slot each"
    ))
    vllm_budget = prediction.budget_bytes
    if kv_cache_memory_bytes is None:
        vllm_budget -= geometry.vision_weights_bytes(tp)
    allocators = pool_models(rank, prediction.budget_bytes, max_num_seqs, block_size,
                             compute_capability=gpu.compute_capability, cuda_major=vllm_cuda_major,
                             vllm_budget_bytes=vllm_budget, checkpoint_slots=checkpoint_slots)
    reasons.append(f"vLLM 0.33 align mode on {gpu.display_name}: {allocators['vllm-0.33-align'].allocator.rule}")
    return Plan(
        spec_name=spec.name,
        geometry=geometry,
        gpu=gpu,
        tensor_parallel_size=tp,
        gpu_memory_utilization=utilization,
        max_num_seqs=max_num_seqs,
        max_model_len=serving.max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        requirement=requirement,
        target_tokens=target,
        reserve_margin=reserve_margin,
        safety_margin_bytes=search.margin_bytes(tp),
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        kv_cache_dtype=serving.kv_cache_dtype,
        prediction=prediction,
        vllm_budget_bytes=vllm_budget,
        allocators=allocators,
        alternatives=tuple(alternatives),
        state_dtypes=state_dtypes,
        workload=plan_workload,
        reasons=tuple(reasons),
        prefix_caching=prefix.enabled,
        checkpoint_interval_tokens=prefix.checkpoint_interval_tokens if prefix.enabled else 0,
        checkpoint_sizing=None if sizing is None else sizing.to_dict(),
    )


def _checkpoint_reason(layout, given: bool, max_num_seqs: int, interval_tokens: int, has_workload: bool,
                       sizing: CheckpointSizing | None) -> str:
    """Why the checkpoint pool is the size it is and what it costs."""
    if given:
        source = "set by serving.prefixCaching.checkpointSlots"
    elif sizing is not None:
        source = f"sized from serving.workload.conversations: replaying {sizing.replayed_conversations} chats at once, "
        if sizing.best_hit_fraction == 0:
            source += ("no prompt shares a whole 16-token block with another, so no count of checkpoints hits; the "
                       f"fewest tried, {sizing.chosen}")
        else:
            source += (f"{sizing.chosen} slots hit {sizing.hit_fraction:.1%} of their prompt tokens, the fewest tried "
                       f"that reach {CHECKPOINT_SIZING_FRACTION:.0%} of the {sizing.best_hit_fraction:.1%} that "
                       f"{max(slots for slots, _ in sizing.tried)} hit")
        if sizing.replayed_conversations < sizing.conversations:
            source += f", scaled to {sizing.conversations} chats"
    else:
        source = f"the default: {DEFAULT_CHECKPOINT_FRACTION:.0%} of max_num_seqs {max_num_seqs}, rounded up"
    interval = (f"every {interval_tokens:,} tokens inside long prompts and " if interval_tokens
                else "")
    text = (f"prefix caching: {layout.checkpoint_slots} GDN state checkpoint slots ({source}) hold "
            f"{layout.checkpoint_pool_bytes / GIB:.2f} GiB beside the state slots, which the token pool would "
            f"otherwise spend on {layout.checkpoint_attention_tokens:,} attention tokens; checkpoints are taken "
            f"{interval}at prompt and reply ends")
    if has_workload and not given and sizing is None:
        text += ("; serving.workload gives request lengths, not shared prefixes, so it does not size them "
                 "(serving.workload.conversations would)")
    return text


def _full_length_alternative(search: _Search, policy: _Policy, tps: list[int], tokens: int, tp_limit: str) -> dict:
    """The fewest GPUs (any valid tp, also beyond the limit) that hold every request at full length."""
    full = search.with_target(tokens)
    every_tp = valid_tensor_parallel_sizes(search.geometry, MAX_TENSOR_PARALLEL_SIZE)
    found = policy.first(full, every_tp)
    if found is None:
        return {"name": REQUIRE_FULL_LENGTH, "fits": False, "target_tokens": tokens}
    return {
        "name": REQUIRE_FULL_LENGTH,
        "fits": True,
        "target_tokens": tokens,
        "tensor_parallel_size": found.tp,
        "gpu_memory_utilization": format_utilization(found.percent),
        "token_capacity": found.prediction.layout.token_capacity,
        "within_limit": found.tp <= tps[-1],
    }


def _state_dtype_capacities(search: _Search, tp: int, percent: int) -> dict[str, int]:
    """Token capacity with a float32 and a bfloat16 recurrent state on the same GPUs and utilization."""
    capacities = {}
    for dtype in ("float32", "bfloat16"):
        candidate = search.with_target(0, ssm_dtype=dtype).evaluate(tp, percent)
        if candidate.prediction is not None:
            capacities[dtype] = candidate.prediction.layout.token_capacity
    return capacities


def _check_fixed_budget(search: _Search, policy: _Policy, tps: list[int]) -> None:
    """A fixed cache budget larger than any allowed GPU count can hold is the user's number, not a shortfall."""
    tp = tps[-1]
    percent = policy.top_percent(search, tp)
    requested = requested_memory_bytes(search.gpu.memory_bytes, format_utilization(percent))
    room = requested - byte_model(search.geometry, tp).weights_bytes - search.reserve_bytes(tp) - search.margin_bytes(tp)
    if search.kv_cache_memory_bytes > room:
        raise CapacityError(
            f"a fixed cache budget of {search.kv_cache_memory_bytes / GIB:,.2f} GiB per rank does not fit: at tp={tp} "
            f"and utilization {format_utilization(percent)} {_article(search.gpu.display_name)} "
            f"{search.gpu.display_name} leaves "
            f"{max(0, room) / GIB:,.2f} GiB beside the weights, the reserve and its margin; give at most that"
        )


def _article(name: str) -> str:
    """"an" before a name read with a vowel sound (an H200, an L4, an A100), else "a"."""
    return "an" if name[:1] in "AEFHILMNORSX" else "a"


def _no_plan_reason(search: _Search, policy: _Policy, tps: list[int], tp_limit: str, requirement: str) -> str:
    """The constraint that stops every allowed (tp, utilization), and the smallest change that would make a plan."""
    gpu_name = search.gpu.display_name
    article = _article(gpu_name)
    first, last = tps[0], tps[-1]
    first_percent = policy.top_percent(search, first)
    usable = requested_memory_bytes(search.gpu.memory_bytes, format_utilization(first_percent))
    if policy.override_percent is not None:
        where = f"at utilization {format_utilization(first_percent)} (overrides.gpuMemoryUtilization),"
    elif policy.shared:
        where = f"at utilization {format_utilization(first_percent)} (the highest planned),"
    else:
        where = f"at utilization {format_utilization(first_percent)} (the highest that leaves the safety margin free),"
    changes = []
    beyond = [tp for tp in valid_tensor_parallel_sizes(search.geometry, MAX_TENSOR_PARALLEL_SIZE) if tp > last]
    more = next((tp for tp in beyond if policy.best(search, tp) is not None), None)
    if more is not None:
        changes.append(f"raise {tp_limit} to {more}" if tp_limit == "gpu.maxPerReplica"
                       else f"set overrides.tensorParallelSize to {more}")
    if policy.override_percent is not None:
        free = _Policy(None, shared=True)
        lowest = next((c for tp in tps if (c := free.best(search, tp)) is not None), None)
        if lowest is not None:
            changes.append(f"raise overrides.gpuMemoryUtilization to {format_utilization(lowest.percent)} "
                           "(or remove it: whole GPUs get the highest the margin allows)")
    top = search.evaluate(last, policy.top_percent(search, last))
    if requirement == REQUIRE_TARGET and top.tokens_with_margin >= search.max_model_len:
        changes.append(f"lower serving.targetTokens to {top.tokens_with_margin:,}")
    slots = _most_slots(search, last, policy.top_percent(search, last), requirement)
    if 0 < slots < search.max_num_seqs:
        changes.append(f"lower serving.maxConcurrency to {slots}")
    advice = "; smallest change: " + ", or ".join(changes) if changes else (
        f"; no valid tp up to {MAX_TENSOR_PARALLEL_SIZE} {gpu_name}s holds it: use a larger GPU"
    )
    weights = byte_model(search.geometry, first).weights_bytes
    overhead = search.reserve_bytes(first) + search.margin_bytes(first)
    if weights >= usable:
        return (f"{search.geometry.name} needs {weights / GIB:.1f} GiB of text-model weights per GPU at tp={first}; "
                f"{where} {article} {gpu_name} gives {usable / GIB:.1f} GiB" + advice)
    if weights + overhead >= usable:
        return (f"{search.geometry.name} needs {weights / GIB:.1f} GiB of text-model weights and "
                f"{overhead / GIB:.1f} GiB of reserve and safety margin per GPU at tp={first}; {where} "
                f"{article} {gpu_name} gives {usable / GIB:.1f} GiB" + advice)
    state_gib = (search.max_num_seqs + 1) * search.rank(last).bytes_per_request / GIB
    held = (f"{search.geometry.name} on {last} × {gpu_name} at utilization "
            f"{format_utilization(policy.top_percent(search, last))} ({tp_limit} allows {last}) holds "
            f"{search.max_num_seqs} state slots ({state_gib:.1f} GiB) and {top.tokens_with_margin:,} tokens with the "
            "safety margin")
    if requirement == REQUIRE_WORKLOAD and top.workload is not None:
        return (f"{held}; replaying serving.workload it preempts {top.workload.preemption_rate:.2%} of requests, "
                f"over the {top.workload.max_preemption_rate:.2%} allowed (serving.workload.maxPreemptionRate)"
                + advice)
    needed = _requirement_text(requirement, search.target_tokens, search.max_num_seqs, search.max_model_len)
    if search.kv_cache_memory_bytes is not None:  # the budget is the user's number, not the GPU's: say so
        fixed_advice = advice if changes else ("; raise it, lower serving.maxConcurrency or serving.maxModelLen, or "
                                               "leave it out to plan from the GPU's memory")
        checkpoints = search.checkpoint_slots
        slots_text = (f"the slots alone take {state_gib:.2f} GiB" if not checkpoints else
                      f"the slots and prefix caching's {checkpoints} checkpoints take "
                      f"{state_gib + checkpoints * search.rank(last).bytes_per_request / GIB:.2f} GiB")
        return (f"a fixed cache budget of {readable_bytes(search.kv_cache_memory_bytes, math.floor)} per rank "
                f"(--kv-cache-memory) holds {top.tokens_with_margin:,} tokens beside {search.max_num_seqs} state "
                f"slots at tp={last} ({slots_text}), short of {needed}{fixed_advice}")
    return f"{held}, short of {needed}" + advice


def _most_slots(search: _Search, tp: int, percent: int, requirement: str) -> int:
    """The most state slots with which `tp` still holds the requirement's tokens (0 if even one slot cannot)."""
    low, high = 0, search.max_num_seqs
    per_request = -(-search.max_model_len // search.block_size) * search.block_size
    candidate = search.evaluate(tp, percent)
    rank = search.rank(tp)
    while low < high:
        middle = (low + high + 1) // 2
        needed = middle * per_request if requirement == REQUIRE_FULL_LENGTH else search.target_tokens
        if search.tokens_for_slots(rank, candidate.margin_budget_bytes, middle) >= needed:
            low = middle
        else:
            high = middle - 1
    return low
