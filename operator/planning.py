"""From a HybridModel object to a plan: parse, resolve the model config and the GPU, call the planner.

The operator never reads the weights: the geometry comes from the catalog, the inline config or a ConfigMap. The
GPU comes from `spec.gpu`, or from GPU Feature Discovery node labels when the spec names none. Every reason no
plan exists is a `PlanFailure` with a CamelCase reason for the Planned condition and the planner's own message.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from hybridkv.errors import UserError
from hybridkv.operator.gpus import GPU_MEMORY_LABEL, GPU_PRODUCT_LABEL, GpuNodeClass, gpu_node_classes
from hybridkv.operator.kube import KubeApi, KubeApiError
from hybridkv.operator.manifests import SidecarSettings
from hybridkv.sizing import (
    CapacityError,
    GeometryError,
    GpuError,
    GpuSpec,
    HybridModelSpec,
    PlanError,
    SpecError,
    TensorParallelError,
    WorkloadError,
    geometry_from_config,
    parse_hybridmodel,
)
from hybridkv.sizing.errors import UnknownModelError
from hybridkv.sizing.planner import Plan, plan
from hybridkv.sizing.simulate import TraceRequest, parse_trace

# Condition reasons for the planner's errors, most specific class first.
FAILURE_REASONS = (
    (SpecError, "InvalidSpec"),
    (UnknownModelError, "UnknownModel"),
    (GeometryError, "InvalidModelConfig"),
    (WorkloadError, "InvalidWorkload"),
    (GpuError, "UnknownGPU"),
    (TensorParallelError, "InvalidTensorParallelSize"),
    (CapacityError, "InsufficientGPUMemory"),
    (PlanError, "NoFeasiblePlan"),
)


class PlanFailure(Exception):
    """No plan for this spec: `reason` (CamelCase), `message` (what to fix), and whether to look again later
    (`retry`: what is missing, a ConfigMap or GPU nodes, may appear without a change of the spec)."""

    def __init__(self, reason: str, message: str, retry: bool = False):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry = retry

    @classmethod
    def from_user_error(cls, exc: UserError) -> PlanFailure:
        reason = next((reason for kind, reason in FAILURE_REASONS if isinstance(exc, kind)), "InvalidSpec")
        return cls(reason, str(exc))


@dataclasses.dataclass(frozen=True)
class PlannedModel:
    plan: Plan
    settings: SidecarSettings
    plan_status: dict


def gpu_node_labels(gpu: GpuSpec) -> tuple[tuple[str, str], ...]:
    """The GFD labels that select nodes with this GPU: its product, or its memory when the product is unknown."""
    if gpu.product:
        return ((GPU_PRODUCT_LABEL, gpu.product),)
    return ((GPU_MEMORY_LABEL, str(gpu.memory_mib)),)


def plan_status(planned: Plan) -> dict:
    """`status.plan`: the planner's choice and prediction per replica, in the CRD's field names."""
    layout = planned.layout
    prediction = planned.prediction
    return {
        "gpu": {"product": planned.gpu.product, "memoryMiB": planned.gpu.memory_mib},
        "tensorParallelSize": planned.tensor_parallel_size,
        "gpusPerReplica": planned.tensor_parallel_size,
        "gpuMemoryUtilization": planned.gpu_memory_utilization,
        # None deletes a value left by an earlier plan (status is merge-patched).
        "kvCacheMemoryBytes": planned.kv_cache_memory_bytes,
        "maxNumSeqs": planned.max_num_seqs,
        "maxModelLen": planned.max_model_len,
        "blockSize": layout.block_size,
        "targetTokens": planned.target_tokens,
        "requirement": planned.requirement,
        "fullLengthRequests": planned.full_length_requests,
        "meanTokensAllRunning": planned.mean_tokens_all_running,
        "ssmStateDtype": planned.prediction.rank_bytes.ssm_dtype,
        "predicted": {
            "weightsBytes": prediction.weights_bytes,
            "reserveBytes": prediction.reserve_bytes,
            "budgetBytes": prediction.budget_bytes,
            "tokenBlocks": layout.token_blocks,
            "tokenCapacity": layout.token_capacity,
            "stateSlots": layout.state_slots,
            "tokenPoolBytes": layout.token_pool_bytes,
            "statePoolBytes": layout.state_pool_bytes,
            "checkpointSlots": layout.checkpoint_slots,
            "checkpointPoolBytes": layout.checkpoint_pool_bytes,
            "checkpointAttentionTokens": layout.checkpoint_attention_tokens,
        },
        "prefixCaching": planned.prefix_caching,
        "checkpointIntervalTokens": planned.checkpoint_interval_tokens,
        "allocators": [
            {
                "name": key,
                "label": figures["label"],
                "blockSize": figures["block_size"],
                "tokenCapacity": figures["token_capacity"],
                "maxConcurrencyAtMaxModelLen": figures["max_concurrency_at_max_model_len"],
            }
            for key, figures in planned.allocator_figures().items()
        ],
        "reasons": list(planned.reasons),
    }


def sidecar_settings(planned: Plan, target_tpot_ms: int | None = None) -> SidecarSettings:
    """The flags of the plan, with the HybridModel's TPOT target (which the plan does not depend on)."""
    return SidecarSettings(
        tensor_parallel_size=planned.tensor_parallel_size,
        gpu_memory_utilization=planned.gpu_memory_utilization,
        max_num_seqs=planned.max_num_seqs,
        max_model_len=planned.max_model_len,
        block_size=planned.layout.block_size,
        max_num_batched_tokens=planned.max_num_batched_tokens,
        kv_cache_memory_bytes=planned.kv_cache_memory_bytes,
        kv_cache_dtype=planned.kv_cache_dtype,
        prefix_checkpoint_slots=planned.layout.checkpoint_slots,
        prefix_checkpoint_interval_tokens=planned.checkpoint_interval_tokens,
        gpu_node_labels=gpu_node_labels(planned.gpu),
        target_tpot_ms=target_tpot_ms,
    )


def choose_gpu_class(spec: HybridModelSpec, classes: list[GpuNodeClass], model_config: dict | None,
                     workload_trace: list[TraceRequest] | None = None) -> Plan:
    """The plan on the discovered GPU class that meets the requirement with the fewest GPUs per replica, then the
    least memory per GPU (bigger GPUs stay free for bigger models).

    Tensor parallelism stays within a node, so a class offers at most its largest `nvidia.com/gpu.count`.
    """
    plans: list[Plan] = []
    reasons: list[str] = []
    for gpu_class in classes:
        gpu = GpuSpec.from_memory_mib(gpu_class.memory_mib, gpu_class.product).with_compute_capability(
            gpu_class.compute_capability)
        node_limit = gpu_class.max_gpus_per_node
        override = spec.overrides.tensor_parallel_size
        if override is not None and override > node_limit:
            reasons.append(f"{gpu_class.product}: overrides.tensorParallelSize {override} > {node_limit} GPUs per node")
            continue
        limit = min(spec.gpu.max_per_replica or node_limit, node_limit)
        capped = dataclasses.replace(spec, gpu=dataclasses.replace(spec.gpu, max_per_replica=limit))
        try:
            plans.append(plan(capped, gpu, model_config=model_config, workload_trace=workload_trace))
        except UserError as exc:
            reasons.append(f"{gpu_class.product}: {exc}")
    if not plans:
        raise PlanFailure("NoGPUFits", "no GPU in the cluster can hold this model: " + "; ".join(reasons))
    return min(plans, key=lambda p: (p.tensor_parallel_size, p.gpu.memory_mib, p.gpu.product))


async def _model_config(spec: HybridModelSpec, namespace: str, kube: KubeApi) -> dict | None:
    ref = spec.model.config_map_ref
    if ref is None:
        return None
    config_map = await kube.get("ConfigMap", namespace, ref.name)
    if config_map is None:
        raise PlanFailure(
            "ModelConfigUnavailable", f"ConfigMap {ref.name} (spec.model.configMapRef) does not exist in {namespace}", retry=True
        )
    text = (config_map.get("data") or {}).get(ref.key)
    if text is None:
        raise PlanFailure(
            "ModelConfigUnavailable", f"ConfigMap {ref.name} has no key {ref.key!r} (spec.model.configMapRef.key)", retry=True
        )
    where = f"ConfigMap {ref.name} key {ref.key!r}"
    try:
        config = json.loads(text)
    except RecursionError:
        raise PlanFailure("InvalidModelConfig", f"{where} nests its JSON too deeply", retry=True) from None
    except ValueError as exc:
        raise PlanFailure("InvalidModelConfig", f"{where} is not JSON: {str(exc)[:200]}", retry=True) from None
    if not isinstance(config, dict):
        raise PlanFailure("InvalidModelConfig", f"{where} is not a JSON object", retry=True)
    # Checked here, as the ConfigMap's own content: a fixed ConfigMap is picked up at the next retry.
    try:
        geometry_from_config(config, name=spec.model.name)
    except GeometryError as exc:
        raise PlanFailure("InvalidModelConfig", f"{where}: {exc}", retry=True) from None
    return config


async def _workload_trace(spec: HybridModelSpec, namespace: str, kube: KubeApi) -> list[TraceRequest] | None:
    workload = spec.serving.workload
    ref = None if workload is None else workload.trace_config_map_ref
    if ref is None:
        return None
    config_map = await kube.get("ConfigMap", namespace, ref.name)
    if config_map is None:
        raise PlanFailure("WorkloadTraceUnavailable",
                          f"ConfigMap {ref.name} (spec.serving.workload.traceConfigMapRef) does not exist in {namespace}",
                          retry=True)
    text = (config_map.get("data") or {}).get(ref.key)
    if text is None:
        raise PlanFailure("WorkloadTraceUnavailable",
                          f"ConfigMap {ref.name} has no key {ref.key!r} (spec.serving.workload.traceConfigMapRef.key)",
                          retry=True)
    try:
        return parse_trace(text.splitlines(), f"ConfigMap {ref.name} key {ref.key!r}")
    except WorkloadError as exc:
        raise PlanFailure("InvalidWorkload", str(exc), retry=True) from None


def _check_engine_takes(spec: HybridModelSpec, planned: Plan) -> None:
    """Settings the plan may use but `hybridkv serve` cannot be told yet fail here rather than deploy another cache."""
    wanted = spec.serving.ssm_state_dtype
    if wanted is not None and wanted != planned.geometry.default_ssm_dtype:
        raise PlanFailure(
            "UnsupportedSSMStateDtype",
            f"spec.serving.ssmStateDtype {wanted}: the sidecar keeps the model config's "
            f"{planned.geometry.default_ssm_dtype} recurrent state and takes no flag to change it; remove the field "
            "(hybridkv plan --ssm-dtype shows what it would hold)",
        )


async def _discovered_classes(kube: KubeApi) -> list[GpuNodeClass]:
    try:
        nodes = await kube.list("Node", None)
    except KubeApiError as exc:
        if exc.status in (401, 403):
            raise PlanFailure(
                "GPUDiscoveryForbidden",
                "the operator may not list nodes to read their GPU labels; set spec.gpu.product or spec.gpu.memoryMiB, "
                "or install the chart with gpuDiscovery.enabled=true",
            ) from None
        raise
    classes = gpu_node_classes(nodes)
    if not classes:
        raise PlanFailure(
            "NoGPUNodes",
            "no Ready node carries the GPU Feature Discovery labels nvidia.com/gpu.product, nvidia.com/gpu.memory and "
            "nvidia.com/gpu.count; set spec.gpu.product or spec.gpu.memoryMiB, or install GPU Feature Discovery",
            retry=True,
        )
    return classes


async def plan_hybridmodel(body: Mapping, kube: KubeApi, gpu_discovery: bool) -> PlannedModel:
    """Parse and plan the HybridModel; PlanFailure says why there is no plan."""
    try:
        spec = parse_hybridmodel({key: body[key] for key in ("apiVersion", "kind", "metadata", "spec")})
    except UserError as exc:
        raise PlanFailure.from_user_error(exc) from None
    model_config = await _model_config(spec, body["metadata"]["namespace"], kube)
    workload_trace = await _workload_trace(spec, body["metadata"]["namespace"], kube)
    names_gpu = spec.gpu.product is not None or spec.gpu.memory_mib is not None
    try:
        if names_gpu:
            planned = plan(spec, model_config=model_config, workload_trace=workload_trace)
        elif not gpu_discovery:
            raise PlanFailure(
                "GPUUnspecified",
                "spec.gpu names no GPU and GPU discovery is off; set spec.gpu.product or spec.gpu.memoryMiB",
            )
        else:
            planned = choose_gpu_class(spec, await _discovered_classes(kube), model_config, workload_trace)
    except UserError as exc:
        raise PlanFailure.from_user_error(exc) from None
    _check_engine_takes(spec, planned)
    return PlannedModel(plan=planned, settings=sidecar_settings(planned, spec.serving.target_tpot_ms),
                        plan_status=plan_status(planned))
