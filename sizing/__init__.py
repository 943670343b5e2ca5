"""hybridkv.sizing: torch-free model geometry, GPU catalog, per-rank byte model, allocators, simulation, planner."""

from hybridkv.sizing.allocators import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHECKPOINT_FRACTION,
    DUAL_POOL,
    IDEAL,
    VLLM_0_20_NONE,
    VLLM_0_33_ALIGN,
    VLLM_0_33_ALIGN_TRITON,
    Allocator,
    DualPoolLayout,
    PoolModel,
    allocators_for,
    default_checkpoint_slots,
    dual_pool_layout,
    dual_pool_max_concurrency,
    pool_model,
    pool_models,
    shared_pool_geometry,
    vllm_align_allocator,
)
from hybridkv.sizing.errors import (
    CapacityError,
    GeometryError,
    GpuError,
    PlanError,
    SpecError,
    TensorParallelError,
    WorkloadError,
)
from hybridkv.sizing.geometry import (
    ModelGeometry,
    catalog_entry,
    catalog_geometry,
    catalog_names,
    dtype_bytes,
    geometry_from_config,
    normalize_dtype,
    read_config_file,
)
from hybridkv.sizing.gpus import GpuSpec, gpu_catalog, gpu_spec
from hybridkv.sizing.memory import (
    KV_CACHE_DTYPES,
    PoolShapes,
    RankBytes,
    byte_model,
    check_tensor_parallel_size,
    kv_cache_dtype,
    valid_tensor_parallel_sizes,
)
from hybridkv.sizing.prediction import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    Prediction,
    estimate_reserve_bytes,
    predict_capacity,
    requested_memory_bytes,
)
from hybridkv.sizing.planner import Plan, plan
from hybridkv.sizing.report import render_plan
from hybridkv.sizing.spec import HybridModelSpec, load_hybridmodel_file, load_hybridmodel_yaml, parse_hybridmodel

__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DUAL_POOL", "IDEAL", "KV_CACHE_DTYPES", "VLLM_0_20_NONE",
    "VLLM_0_33_ALIGN", "VLLM_0_33_ALIGN_TRITON", "Allocator", "allocators_for", "vllm_align_allocator", "CapacityError", "DualPoolLayout", "GeometryError", "GpuError", "GpuSpec",
    "ModelGeometry", "PlanError", "PoolModel", "PoolShapes", "Prediction", "RankBytes", "SpecError", "TensorParallelError",
    "WorkloadError", "byte_model", "catalog_entry", "catalog_geometry", "catalog_names",
    "check_tensor_parallel_size", "dtype_bytes", "dual_pool_layout", "default_checkpoint_slots",
    "DEFAULT_CHECKPOINT_FRACTION", "dual_pool_max_concurrency", "estimate_reserve_bytes", "geometry_from_config",
    "gpu_catalog", "gpu_spec", "kv_cache_dtype", "normalize_dtype", "pool_model", "read_config_file",
    "pool_models", "predict_capacity", "requested_memory_bytes", "shared_pool_geometry",
    "valid_tensor_parallel_sizes", "HybridModelSpec", "load_hybridmodel_file", "load_hybridmodel_yaml",
    "parse_hybridmodel", "Plan", "plan", "render_plan",
]
