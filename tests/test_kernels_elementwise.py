"""The fused Triton kernels equal their plain-torch references (under the Triton interpreter on CPU; `-m gpu` on CUDA)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels import elementwise as fused_kernels
from hybridkv.sidecar.fused_ops import (
    gated_rms_norm_reference,
    rms_norm_reference,
    rotary_reference,
    silu_and_mul_reference,
)

EPS = 1e-6
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# bf16: two rounding steps at most (reduction order; the interpreter rounds bf16 its own way); fp32: to rounding.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close(ours, reference, dtype):
    scale = reference.float().abs().max().clamp(min=1.0)
    assert ((ours.float() - reference.float()).abs().max() / scale).item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_and_zero_centred_norm(dtype, device, torch_generator):
    x = torch.randn(5, 96, generator=torch_generator).to(device, dtype)
    residual = (torch.randn(5, 96, generator=torch_generator) * 4).to(device, dtype)
    weight = (torch.randn(96, generator=torch_generator) * 0.1).to(device, dtype)
    ours, ours_residual = fused_kernels.rms_norm(x, weight, EPS, residual)
    reference, reference_residual = rms_norm_reference(x, weight, EPS, residual)
    if device == "cuda":
        assert torch.equal(ours_residual, reference_residual)  # rounded exactly as torch rounds `residual + x`
    assert_close(ours_residual, reference_residual, dtype)  # the interpreter rounds bf16 its own way
    assert_close(ours, reference, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norm_of_a_strided_view(dtype, device, torch_generator):
    """q as it leaves the merged projection: [T, H, D] interleaved with the gate, so rows are not contiguous."""
    merged = torch.randn(3, 4, 2 * 32, generator=torch_generator).to(device, dtype)
    q = merged[..., :32]
    weight = (torch.randn(32, generator=torch_generator) * 0.1).to(device, dtype)
    assert_close(fused_kernels.rms_norm(q, weight, EPS), rms_norm_reference(q, weight, EPS), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_with_a_strided_gate(dtype, device, torch_generator):
    x = torch.randn(6, 4, 16, generator=torch_generator).to(device, dtype)
    projection = torch.randn(6, 4 * 16 + 8, generator=torch_generator).to(device, dtype)
    gate = projection[:, 8:].view(6, 4, 16)
    weight = (1 + torch.randn(16, generator=torch_generator) * 0.1).to(device, dtype)
    assert_close(fused_kernels.gated_rms_norm(x, gate, weight, EPS), gated_rms_norm_reference(x, gate, weight, EPS),
                 dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_of_q_and_k(dtype, device, torch_generator):
    """Qwen3.5's shape in small: 64 of 256 dims rotated, GQA head counts, positions far apart."""
    q = torch.randn(5, 4, 256, generator=torch_generator).to(device, dtype)
    k = torch.randn(5, 2, 256, generator=torch_generator).to(device, dtype)
    positions = torch.tensor([0, 1, 17, 4095, 262143], device=device)
    inv_freq = (1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))).to(device)
    ours = fused_kernels.rotary(positions, q, k, inv_freq, 64)
    reference = rotary_reference(positions, q, k, inv_freq, 64)
    for got, expected in zip(ours, reference):
        assert torch.equal(got[..., 64:], expected[..., 64:])  # the unrotated dims pass through untouched
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_of_a_merged_projection(dtype, device, torch_generator):
    x = (torch.randn(3, 2 * 1500, generator=torch_generator) * 3).to(device, dtype)
    assert_close(fused_kernels.silu_and_mul(x), silu_and_mul_reference(x), dtype)
