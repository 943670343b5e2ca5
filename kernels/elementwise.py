"""The model's elementwise steps (RMSNorm with the residual add, the gated norm, rotary, SwiGLU) fused in Triton: one
program per row (a token, or a token's head), no host syncs.

A decode step of the 4B model runs ~100 norms, 8 rotaries and 32 SwiGLU activations; unfused they are ~1,000 small
launches, which cost more than reading the weights at small batch. The kernels round where their references in
`hybridkv.kernels.reference` (and transformers' Qwen3.5) round.

Norm inputs may be strided views (q and the gate come out of merged projections): rows are addressed as (token, head)
with a stride for each, and the last dim must be contiguous. Outputs are new contiguous tensors.

Before an FP8 projection, RMSNorm and SwiGLU also write their output quantized for it (`fp8_group`: e4m3 values and a
scale per token and group of channels, as `fp8_gemm.quantize_activations` would make them from the output, bit for
bit), so the projection's GEMM starts without a quantization launch of its own (`fp8_gemm.attach_quantized`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.sizing.quantization import E4M3_MAX

from .fp8_gemm import CUBLAS_MIN_TOKENS, attach_quantized, quantized_group
from .quant_reference import MIN_AMAX
from .triton_utils import (DEFAULT_PREFETCH_LIMITS, INTERPRETED, cdiv, dependent_launch, early_release,
                           l2_prefetch_plan, next_power_of_2, no_prefetch_args, prefetch_to_l2, release_after_wait,
                           release_at_start, release_dependents, round_to_e4m3_grid, wait_for_producer)

_FP8_MAX = tl.constexpr(E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(MIN_AMAX)
# The interpreter's float32 -> e4m3 cast mis-rounds values that round up into the next power of two.
_ROUND_IN_FLOAT32 = tl.constexpr(INTERPRETED)


@triton.jit
def _store_quantized(y, q_ptr, s_ptr, first, width, row, groups, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Channels first..first + BLOCK of row `row` (float32 `y`, already rounded to the output dtype; zeros past
    `width`) quantized per group of GROUP channels into the e4m3 values `[rows, width]` and float32 scales
    `[rows, groups]`."""
    scales, values = quantized_group(tl.reshape(y, (BLOCK // GROUP, GROUP)), _FP8_MAX, _AMAX_FLOOR)
    if _ROUND_IN_FLOAT32:
        values = round_to_e4m3_grid(values)
    cols = first + tl.arange(0, BLOCK)
    tl.store(q_ptr + row * width + cols, tl.reshape(values, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=cols < width)
    group_ids = first // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + row * groups + group_ids, scales, mask=group_ids < groups)


@triton.jit(do_not_specialize=["num_rows"])  # a step's token count: one compile for every step
def _norm_kernel(x_ptr, residual_ptr, weight_ptr, gate_ptr, out_ptr, residual_out_ptr, q_ptr, s_ptr, num_heads,
                 stride_x_token, stride_x_head, stride_residual_token, stride_gate_token, stride_gate_head, dim, eps,
                 num_rows, pf_a_ptr, pf_a_bytes, pf_a_lane_bytes, pf_b_ptr, pf_b_bytes, pf_b_lane_bytes,
                 HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, BLOCK_D: tl.constexpr, FP8_GROUP: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr, LANES: tl.constexpr, EARLY: tl.constexpr):
    release_at_start(PDL, EARLY)
    row = tl.program_id(0).to(tl.int64)
    if PREFETCH:
        if row >= num_rows:
            # Programs past the rows ask the L2 for the next projection's weights (`triton_utils.prefetch_to_l2`).
            prefetch_to_l2(pf_a_ptr, pf_a_bytes, pf_a_lane_bytes, pf_b_ptr, pf_b_bytes, pf_b_lane_bytes,
                           row - num_rows, LANES)
            return
    token = row // num_heads
    head = row % num_heads
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    # The weight is a parameter, so it is read before the wait; every input may come from the kernel before.
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_producer(PDL)
    x = tl.load(x_ptr + token * stride_x_token + head * stride_x_head + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * stride_residual_token + cols, mask=mask, other=0.0)
    release_after_wait(PDL, EARLY)
    if HAS_RESIDUAL:
        # Rounded to the activation dtype before the norm reads it, as `residual + x` is in torch.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * dim + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    x32 = x32 / tl.sqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
    if GATED:
        normed = (weight * x32.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
        gate = tl.load(gate_ptr + token * stride_gate_token + head * stride_gate_head + cols, mask=mask,
                       other=0.0).to(tl.float32)
        y = normed.to(tl.float32) * gate * tl.sigmoid(gate)
    else:
        y = x32 * (1.0 + weight)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * dim + cols, y, mask=mask)
    if FP8_GROUP:
        _store_quantized(y.to(tl.float32), q_ptr, s_ptr, 0, dim, row, tl.cdiv(dim, FP8_GROUP), FP8_GROUP, BLOCK_D)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, token stride, head stride) of a [T, D] or [T, H, D] tensor with a contiguous last dim."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _quantized_outputs(out: torch.Tensor, fp8_group: int | None, block: int):
    """(group, e4m3 values, scales) a kernel writing `out` `[T, C]` also fills for FP8 projections of group
    `fp8_group` (whole groups per program of `block` channels), attached to `out`; (None, out, out) when it does
    not: no group, or a prefill-sized batch."""
    if not fp8_group or block % fp8_group or out.dim() != 2 or out.shape[0] >= CUBLAS_MIN_TOKENS:
        # Prefill-sized products quantize in cuBLASLt's layout (`Fp8Activations.for_cublas`).
        return None, out, out
    tokens, width = out.shape
    values = torch.empty(tokens, width, dtype=torch.float8_e4m3fn, device=out.device)
    scales = torch.empty(tokens, cdiv(width, fp8_group), dtype=torch.float32, device=out.device)
    attach_quantized(out, values, scales, fp8_group)
    return fp8_group, values, scales


def _launch(x, weight, eps, residual=None, gate=None, fp8_group=None, prefetch=(),
            prefetch_limits=DEFAULT_PREFETCH_LIMITS):
    x = x if x.stride(-1) == 1 else x.contiguous()
    tokens, heads, stride_token, stride_head = _rows(x)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    gate_strides = _rows(gate)[2:] if gate is not None else (0, 0)
    block = next_power_of_2(dim)
    group, values, scales = _quantized_outputs(out, fp8_group if gate is None else None, block)
    if tokens * heads:
        pdl = dependent_launch(x.device)
        num_warps = max(1, min(8, block // 256))
        plan = l2_prefetch_plan(prefetch, tokens, 32 * num_warps, x.device, prefetch_limits)
        _norm_kernel[(tokens * heads + (plan.programs if plan else 0),)](
            x, residual if residual is not None else x, weight, gate if gate is not None else x, out, residual_out,
            values, scales, heads, stride_token, stride_head, residual.stride(0) if residual is not None else 0,
            *gate_strides, dim, eps, tokens * heads, *(plan.args() if plan else no_prefetch_args(x)),
            HAS_RESIDUAL=residual is not None, GATED=gate is not None, BLOCK_D=block, FP8_GROUP=group or 0, PDL=pdl,
            PREFETCH=plan is not None, LANES=32 * num_warps, EARLY=early_release(x.device), num_warps=num_warps,
            launch_pdl=pdl,
        )
    return out, residual_out


def rms_norm(x, weight, eps, residual=None, fp8_group=None, prefetch=(), prefetch_limits=DEFAULT_PREFETCH_LIMITS):
    out, residual_out = _launch(x, weight, eps, residual=residual, fp8_group=fp8_group, prefetch=prefetch,
                                prefetch_limits=prefetch_limits)
    return out if residual is None else (out, residual_out)


def gated_rms_norm(x, gate, weight, eps):
    return _launch(x, weight, eps, gate=gate)[0]


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, inv_freq_ptr, num_q_heads, head_dim,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_k_heads = tl.num_programs(1) - num_q_heads
    is_q = head < num_q_heads
    if is_q:
        row_offset = (token * num_q_heads + head) * head_dim
        x_ptr, out_ptr = q_ptr + row_offset, q_out_ptr + row_offset
    else:
        row_offset = (token * num_k_heads + head - num_q_heads) * head_dim
        x_ptr, out_ptr = k_ptr + row_offset, k_out_ptr + row_offset
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    passed = (cols >= 2 * HALF) & (cols < head_dim)
    tl.store(out_ptr + cols, tl.load(x_ptr + cols, mask=passed), mask=passed)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + offs, mask=mask, other=0.0)
    # cos and sin are rounded to the activation dtype, and each product and sum rounded, as the torch form does.
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(dtype).to(tl.float32)
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, out1.to(dtype), mask=mask)
    tl.store(out_ptr + HALF + offs, out2.to(dtype), mask=mask)


def rotary(positions, q, k, inv_freq, rotary_dim):
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens:
        half = rotary_dim // 2
        _rotary_kernel[(num_tokens, num_q_heads + k.shape[1])](
            q, k, q_out, k_out, positions, inv_freq, num_q_heads, head_dim, HALF=half,
            BLOCK_HALF=next_power_of_2(half), BLOCK_D=next_power_of_2(head_dim), num_warps=1,
        )
    return q_out, k_out


@triton.jit
def _normed(x_ptr, weight_ptr, cols, mask, rms, dtype):
    """Columns `cols` of a row after `_norm_kernel`'s ungated norm (`rms` its root mean square), rounded to `dtype`
    as that kernel stores them, back in float32."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return ((x / rms) * (1.0 + weight)).to(dtype).to(tl.float32)


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _qk_norm_rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr, positions_ptr,
                           inv_freq_ptr, num_q_heads, stride_q_token, stride_q_head, stride_k_token, stride_k_head,
                           head_dim, eps, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                           PDL: tl.constexpr, EARLY: tl.constexpr):
    """Attention's per-head q and k norms and the rotary after them, one (token, head) row a program: the values
    `_norm_kernel` then `_rotary_kernel` would store, in one launch."""
    release_at_start(PDL, EARLY)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_k_heads = tl.num_programs(1) - num_q_heads
    if head < num_q_heads:
        x_ptr = q_ptr + token * stride_q_token + head * stride_q_head
        out_ptr = q_out_ptr + (token * num_q_heads + head) * head_dim
        weight_ptr = q_weight_ptr
    else:
        x_ptr = k_ptr + token * stride_k_token + (head - num_q_heads) * stride_k_head
        out_ptr = k_out_ptr + (token * num_k_heads + head - num_q_heads) * head_dim
        weight_ptr = k_weight_ptr
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    # The angles need only the position: computed before the wait.
    angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + offs, mask=mask, other=0.0)
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(dtype).to(tl.float32)
    wait_for_producer(PDL)
    cols = tl.arange(0, BLOCK_D)
    row = tl.load(x_ptr + cols, mask=cols < head_dim, other=0.0).to(tl.float32)
    release_after_wait(PDL, EARLY)
    # Summed as `_norm_kernel` sums its row (same block, same warps), so the norm is the same to the bit.
    rms = tl.sqrt(tl.sum(row * row, axis=0) / head_dim + eps)
    passed = (cols >= 2 * HALF) & (cols < head_dim)
    tl.store(out_ptr + cols, _normed(x_ptr, weight_ptr, cols, passed, rms, dtype).to(dtype), mask=passed)
    x1 = _normed(x_ptr, weight_ptr, offs, mask, rms, dtype)
    x2 = _normed(x_ptr, weight_ptr, HALF + offs, mask, rms, dtype)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, out1.to(dtype), mask=mask)
    tl.store(out_ptr + HALF + offs, out2.to(dtype), mask=mask)


def qk_norm_rotary(q, k, q_weight, k_weight, eps, positions, inv_freq, rotary_dim):
    """`rotary(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), inv_freq, rotary_dim)` in one
    launch: q `[T, Hq, D]` and k `[T, Hkv, D]` (strided heads allowed, the last dim contiguous) -> new contiguous
    (q, k)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    num_tokens, num_q_heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = rotary_dim // 2
        block = next_power_of_2(head_dim)
        pdl = dependent_launch(q.device)
        _qk_norm_rotary_kernel[(num_tokens, num_q_heads + k.shape[1])](
            q, k, q_out, k_out, q_weight, k_weight, positions, inv_freq, num_q_heads, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), head_dim, eps, HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_D=block,
            PDL=pdl, EARLY=early_release(q.device), num_warps=max(1, min(8, block // 256)), launch_pdl=pdl,
        )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, s_ptr, stride_x_row, width, BLOCK: tl.constexpr,
                         FP8_GROUP: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    wait_for_producer(PDL)
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + width + cols, mask=mask, other=0.0).to(tl.float32)
    release_dependents(PDL)
    activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    y = (activated * up).to(dtype)
    tl.store(out_ptr + row * width + cols, y, mask=mask)
    if FP8_GROUP:
        _store_quantized(y.to(tl.float32), q_ptr, s_ptr, tl.program_id(1) * BLOCK, width, row,
                         tl.cdiv(width, FP8_GROUP), FP8_GROUP, BLOCK)


_SILU_BLOCK = 1024


def silu_and_mul(x, fp8_group=None):
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    group, values, scales = _quantized_outputs(out, fp8_group, _SILU_BLOCK)
    if num_tokens:
        pdl = dependent_launch(x.device)
        _silu_and_mul_kernel[(num_tokens, cdiv(width, _SILU_BLOCK))](
            x, out, values, scales, x.stride(0), width, BLOCK=_SILU_BLOCK, FP8_GROUP=group or 0, PDL=pdl,
            num_warps=4, launch_pdl=pdl)
    return out
