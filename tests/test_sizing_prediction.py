"""The planner's prediction: requested memory, the reserve estimate, and the budget handed to the dual pool."""

from __future__ import annotations

import pytest

from hybridkv.sizing import (
    CapacityError,
    byte_model,
    catalog_geometry,
    estimate_reserve_bytes,
    gpu_spec,
    predict_capacity,
    requested_memory_bytes,
)
from hybridkv.sizing.gpus import GpuSpec

GIB = 2**30
H200_BYTES = 143_771 * 2**20


def test_h200_memory_and_requested_bytes_match_the_reference():
    # What CUDA reports as an H200's total (torch.cuda.mem_get_info, measured on one H200), which utilization
    # multiplies in the engine and in vLLM; GPU Feature Discovery's 143,771 MiB also counts memory the driver keeps.
    assert gpu_spec("h200").memory_bytes == 150_109_880_320
    assert gpu_spec("h200").memory_mib == 143_771
    assert gpu_spec("NVIDIA-H200") == gpu_spec("H200")
    # ceil(150,754,820,096 × 0.9), exactly (no float rounding)
    assert requested_memory_bytes(H200_BYTES, "0.9") == 135_679_338_087
    assert requested_memory_bytes(H200_BYTES, 0.9) == 135_679_338_087


def test_budget_is_requested_minus_weights_minus_reserve():
    geometry = catalog_geometry("qwen3.5-4b")
    prediction = predict_capacity(geometry, 1, H200_BYTES, "0.90", max_num_seqs=256, max_num_batched_tokens=8192)
    assert prediction.weights_bytes == 2 * 4_205_751_296
    assert prediction.reserve_bytes == estimate_reserve_bytes(geometry, 1, 8192, 256)
    assert prediction.budget_bytes == 135_679_338_087 - prediction.weights_bytes - prediction.reserve_bytes
    layout = prediction.layout
    rank = byte_model(geometry)
    assert layout.state_slots == 256
    assert layout.state_pool_bytes == 257 * rank.bytes_per_request
    assert layout.token_blocks == (prediction.budget_bytes - layout.state_pool_bytes) // (16 * 32_768) - 1


def test_reserve_estimate_is_in_the_measured_range_for_4b():
    """Measured on an H200 with transformers: ~1.1–1.3 GiB of activations at 8192 tokens, 0.24 GiB of fp32 logits at 256 rows, ~0.5 GiB
    CUDA context, plus CUDA graphs: the estimate must land between 2 and 4 GiB, and grow with S and tokens."""
    geometry = catalog_geometry("qwen3.5-4b")
    reserve = estimate_reserve_bytes(geometry, 1, 8192, 256)
    assert 2 * GIB < reserve < 4 * GIB
    assert estimate_reserve_bytes(geometry, 1, 8192, 1024) > reserve
    assert estimate_reserve_bytes(geometry, 1, 16384, 256) > reserve
    assert estimate_reserve_bytes(catalog_geometry("qwen3.5-27b"), 1, 8192, 256) > reserve


def test_the_moe_activation_term_counts_the_fused_kernels_rows():
    """Each token's choices pass the fused MoE as rows of a SwiGLU product (moe_intermediate / tp) and a weighted down
    projection (hidden), the shared expert one row more when it runs in the stack; a wider shared expert runs its
    own gate+up instead. The 35B-A3B FP8 start-up measured on an H100 (bench/results/throughput-2026-12-06-h100-
    qwen3.5-35b-a3b-fp8.json) held 4.26 GB besides weights and cache; this term brings the estimate to 4.10 GB."""
    import dataclasses

    from hybridkv.sizing.prediction import widest_projection_per_rank

    geometry = catalog_geometry("qwen3.5-35b-a3b")
    assert geometry.shared_expert_in_stack
    assert widest_projection_per_rank(geometry, 1) == 9 * (512 + 2048) + 2 * 256
    assert widest_projection_per_rank(geometry, 2) == 9 * (256 + 2048) + 2 * 256
    wide = dataclasses.replace(geometry, shared_expert_intermediate_size=1024)
    assert not wide.shared_expert_in_stack
    assert widest_projection_per_rank(wide, 1) == 8 * (512 + 2048) + 2 * 1024 + 2 * 256
    assert 4.05e9 < estimate_reserve_bytes(geometry, 1, 8192, 256) < 4.26e9


def test_fixed_cache_memory_is_the_budget_exactly():
    prediction = predict_capacity(
        catalog_geometry("qwen3.5-0.8b"), 1, H200_BYTES, "0.5", 8, kv_cache_memory_bytes=3 * GIB
    )
    assert prediction.budget_bytes == 3 * GIB


@pytest.mark.parametrize("utilization", ["0", "1.01", "-0.5", "abc", True, "nan"])
def test_utilization_outside_zero_one_is_rejected(utilization):
    with pytest.raises(CapacityError, match="gpu_memory_utilization"):
        predict_capacity(catalog_geometry("qwen3.5-4b"), 1, H200_BYTES, utilization, 16)


def test_weights_that_do_not_fit_say_so():
    l4 = gpu_spec("l4")
    with pytest.raises(CapacityError, match="Qwen3.5-27B at tp=1: 50.10 GiB of weights"):
        predict_capacity(catalog_geometry("qwen3.5-27b"), 1, l4.memory_bytes, "0.95", 8)


def test_gpu_known_only_by_memory():
    gpu = GpuSpec.from_memory_mib(98_304)
    assert gpu.memory_bytes == 98_304 * 2**20 and gpu.product == ""
    assert GpuSpec.from_memory_mib(23_034, "NVIDIA-L4") == gpu_spec("l4")
    with pytest.raises(Exception, match="MiB"):
        GpuSpec.from_memory_mib(0)


@pytest.mark.parametrize(
    ("alias", "product", "memory_mib"),
    [
        ("h100", "NVIDIA-H100-80GB-HBM3", 81_559),
        ("h200", "NVIDIA-H200", 143_771),
        ("b200", "NVIDIA-B200", 183_359),
        ("a100-40gb", "NVIDIA-A100-SXM4-40GB", 40_960),
        ("a100-80gb", "NVIDIA-A100-SXM4-80GB", 81_920),
        ("l40s", "NVIDIA-L40S", 46_068),
        ("l4", "NVIDIA-L4", 23_034),
    ],
)
def test_gpu_catalog_uses_gpu_feature_discovery_figures(alias, product, memory_mib):
    by_alias, by_product = gpu_spec(alias), gpu_spec(product.lower())
    assert by_alias == by_product
    assert (by_alias.product, by_alias.memory_mib) == (product, memory_mib)


def test_unknown_gpu_lists_the_known_ones():
    from hybridkv.sizing import GpuError

    with pytest.raises(GpuError, match="unknown GPU 'NVIDIA-T4'.*l4 \\(NVIDIA-L4\\)"):
        gpu_spec("NVIDIA-T4")
