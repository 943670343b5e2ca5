"""The fused Triton norms equal their plain-torch references (run under the Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.sidecar import norm_kernels
from hybridkv.sidecar.norms import gated_rms_norm_reference, rms_norm_reference

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
    ours, ours_residual = norm_kernels.rms_norm(x, weight, EPS, residual)
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
    assert_close(norm_kernels.rms_norm(q, weight, EPS), rms_norm_reference(q, weight, EPS), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_with_a_strided_gate(dtype, device, torch_generator):
    x = torch.randn(6, 4, 16, generator=torch_generator).to(device, dtype)
    projection = torch.randn(6, 4 * 16 + 8, generator=torch_generator).to(device, dtype)
    gate = projection[:, 8:].view(6, 4, 16)
    weight = (1 + torch.randn(16, generator=torch_generator) * 0.1).to(device, dtype)
    assert_close(norm_kernels.gated_rms_norm(x, gate, weight, EPS), gated_rms_norm_reference(x, gate, weight, EPS),
                 dtype)
