"""The elementwise Triton kernels equal their plain-torch references (under the Triton interpreter on CPU; `-m gpu` on
CUDA), and the model's calls into them follow `HYBRIDKV_KERNELS` as every kernel does."""

from __future__ import annotations

import pytest
import torch

from hybridkv import kernels
from hybridkv.errors import UserError
from hybridkv.kernels import elementwise, reference

EPS = 1e-6
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# bf16: two rounding steps at most (reduction order; the interpreter rounds bf16 its own way); fp32: to rounding.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close(ours, expected, dtype):
    scale = expected.float().abs().max().clamp(min=1.0)
    assert ((ours.float() - expected.float()).abs().max() / scale).item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_and_zero_centred_norm(dtype, device, torch_generator):
    x = torch.randn(5, 96, generator=torch_generator).to(device, dtype)
    residual = (torch.randn(5, 96, generator=torch_generator) * 4).to(device, dtype)
    weight = (torch.randn(96, generator=torch_generator) * 0.1).to(device, dtype)
    ours, ours_residual = elementwise.rms_norm(x, weight, EPS, residual)
    want, want_residual = reference.rms_norm(x, weight, EPS, residual)
    if device == "cuda":
        assert torch.equal(ours_residual, want_residual)  # rounded exactly as torch rounds `residual + x`
    assert_close(ours_residual, want_residual, dtype)  # the interpreter rounds bf16 its own way
    assert_close(ours, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norm_of_a_strided_view(dtype, device, torch_generator):
    """q as it leaves the merged projection: [T, H, D] interleaved with the gate, so rows are not contiguous."""
    merged = torch.randn(3, 4, 2 * 32, generator=torch_generator).to(device, dtype)
    q = merged[..., :32]
    weight = (torch.randn(32, generator=torch_generator) * 0.1).to(device, dtype)
    assert_close(elementwise.rms_norm(q, weight, EPS), reference.rms_norm(q, weight, EPS), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_with_a_strided_gate(dtype, device, torch_generator):
    x = torch.randn(6, 4, 16, generator=torch_generator).to(device, dtype)
    projection = torch.randn(6, 4 * 16 + 8, generator=torch_generator).to(device, dtype)
    gate = projection[:, 8:].view(6, 4, 16)
    weight = (1 + torch.randn(16, generator=torch_generator) * 0.1).to(device, dtype)
    assert_close(elementwise.gated_rms_norm(x, gate, weight, EPS), reference.gated_rms_norm(x, gate, weight, EPS),
                 dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_qk_norm_and_rotary_in_one_launch_equal_the_three_launches(dtype, device, tokens, torch_generator):
    """Qwen3.5's attention in small: q strided between its gate heads, k a slice of the merged projection, 64 of 256
    dims rotated; the fused kernel stores what the two norms and the rotary store, to the bit."""
    merged = torch.randn(tokens, 4 * 2 * 256 + 2 * 2 * 256, generator=torch_generator).to(device, dtype)
    q = merged[:, : 4 * 2 * 256].view(tokens, 4, 2 * 256)[..., :256]
    k = merged[:, 4 * 2 * 256 : 4 * 2 * 256 + 2 * 256].view(tokens, 2, 256)
    q_weight = (torch.randn(256, generator=torch_generator) * 0.1).to(device, dtype)
    k_weight = (torch.randn(256, generator=torch_generator) * 0.1).to(device, dtype)
    positions = torch.tensor([0, 1, 17, 4095, 262143][:tokens], device=device)
    inv_freq = (1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))).to(device)
    ours = elementwise.qk_norm_rotary(q, k, q_weight, k_weight, EPS, positions, inv_freq, 64)
    apart = elementwise.rotary(positions, elementwise.rms_norm(q, q_weight, EPS), elementwise.rms_norm(k, k_weight, EPS),
                               inv_freq, 64)
    want = reference.qk_norm_rotary(q, k, q_weight, k_weight, EPS, positions, inv_freq, 64)
    for got, three_launches, expected in zip(ours, apart, want):
        assert got.shape == expected.shape and got.is_contiguous()
        assert torch.equal(got, three_launches)
        if tokens:
            assert_close(got, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_of_q_and_k(dtype, device, torch_generator):
    """Qwen3.5's shape in small: 64 of 256 dims rotated, GQA head counts, positions far apart."""
    q = torch.randn(5, 4, 256, generator=torch_generator).to(device, dtype)
    k = torch.randn(5, 2, 256, generator=torch_generator).to(device, dtype)
    positions = torch.tensor([0, 1, 17, 4095, 262143], device=device)
    inv_freq = (1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))).to(device)
    ours = elementwise.rotary(positions, q, k, inv_freq, 64)
    want = reference.rotary(positions, q, k, inv_freq, 64)
    for got, expected in zip(ours, want):
        assert torch.equal(got[..., 64:], expected[..., 64:])  # the unrotated dims pass through untouched
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_of_a_merged_projection(dtype, device, torch_generator):
    x = (torch.randn(3, 2 * 1500, generator=torch_generator) * 3).to(device, dtype)
    assert_close(elementwise.silu_and_mul(x), reference.silu_and_mul(x), dtype)


def test_elementwise_steps_follow_the_kernel_mode(torch_generator, monkeypatch):
    """`auto` on CPU is the reference, `triton` the kernel under the interpreter, and a mode that does not exist is
    refused by name rather than silently taken as one of them."""
    x = torch.randn(4, 64, generator=torch_generator).to(torch.bfloat16)
    weight = (torch.randn(64, generator=torch_generator) * 0.1).to(torch.bfloat16)
    want = reference.rms_norm(x, weight, EPS)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "auto")
    assert torch.equal(kernels.rms_norm(x, weight, EPS), want)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    assert_close(kernels.rms_norm(x, weight, EPS), want, torch.bfloat16)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "fused")
    with pytest.raises(UserError, match="HYBRIDKV_KERNELS='fused' is not one of auto, reference, triton"):
        kernels.silu_and_mul(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["rms_norm", "rms_norm_residual", "silu_and_mul"])
@pytest.mark.parametrize("width", [256, 300, 1100])  # whole groups; a partial last group; past one SwiGLU block
def test_outputs_for_fp8_projections_come_quantized_as_the_projection_would_quantize_them(kernel, width, device,
                                                                                         torch_generator,
                                                                                         monkeypatch):
    """With `fp8_group`, the norm and SwiGLU also write their output's e4m3 values and per-group scales, equal bit for
    bit to `quantize_activations` of that output, which itself is unchanged; the FP8 product then launches no
    quantization and gives the same result."""
    from hybridkv.kernels import fp8_gemm, quant_reference

    x = torch.randn(3, width * (2 if kernel == "silu_and_mul" else 1), generator=torch_generator)
    x = (x * 3).to(device, torch.bfloat16)
    residual = torch.randn(3, width, generator=torch_generator).to(device, torch.bfloat16)
    weight = (torch.randn(width, generator=torch_generator) * 0.1).to(device, torch.bfloat16)

    def run(fp8_group):
        if kernel == "silu_and_mul":
            return elementwise.silu_and_mul(x, fp8_group)
        out = elementwise.rms_norm(x, weight, EPS, residual if kernel == "rms_norm_residual" else None, fp8_group)
        return out[0] if kernel == "rms_norm_residual" else out

    out, plain = run(128), run(None)
    assert torch.equal(out, plain)
    expected_values, expected_scales = fp8_gemm.quantize_activations(plain, 128)
    values, scales = fp8_gemm.Fp8Activations(out, 128).by_row()
    assert torch.equal(values.float(), expected_values.float()) and torch.equal(scales, expected_scales)
    assert fp8_gemm.Fp8Activations(out, 64)._by_row is None  # another group quantizes for itself
    assert fp8_gemm.Fp8Activations(plain, 128)._by_row is None

    w, w_scale = (t.to(device) for t in quant_reference.quantize_fp8_block(
        torch.randn(64, width, generator=torch_generator), (128, 128)))
    launches = []
    quantize = fp8_gemm.quantize_activations
    monkeypatch.setattr(fp8_gemm, "quantize_activations", lambda *a, **k: launches.append(1) or quantize(*a, **k))
    fused = fp8_gemm.fp8_linear(out, w, w_scale, (128, 128))
    assert not launches
    assert torch.equal(fused, fp8_gemm.fp8_linear(plain, w, w_scale, (128, 128))) and len(launches) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_sized_outputs_are_not_quantized_by_their_producer(device, torch_generator):
    """From cuBLASLt's batch size on, the projection quantizes in cuBLASLt's own layout: the producer leaves it."""
    from hybridkv.kernels import fp8_gemm

    x = torch.randn(fp8_gemm.CUBLAS_MIN_TOKENS, 256, generator=torch_generator).to(device, torch.bfloat16)
    weight = torch.zeros(256, dtype=torch.bfloat16, device=device)
    assert fp8_gemm.Fp8Activations(elementwise.rms_norm(x, weight, EPS, None, 128), 128)._by_row is None
    assert fp8_gemm.Fp8Activations(elementwise.rms_norm(x[:-1], weight, EPS, None, 128), 128)._by_row is not None
