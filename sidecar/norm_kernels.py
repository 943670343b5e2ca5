"""Triton kernels of `hybridkv.sidecar.norms`: one program per row (a token, or a token's head), no host syncs.

Inputs may be strided views (q, k and the gate come out of merged projections): rows are addressed as (token, head)
with a stride for each, and the last dim must be contiguous. Outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_kernel(x_ptr, residual_ptr, weight_ptr, gate_ptr, out_ptr, residual_out_ptr, num_heads, stride_x_token,
                 stride_x_head, stride_residual_token, stride_gate_token, stride_gate_head, dim, eps,
                 HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    token = row // num_heads
    head = row % num_heads
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    x = tl.load(x_ptr + token * stride_x_token + head * stride_x_head + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * stride_residual_token + cols, mask=mask, other=0.0)
        # Rounded to the activation dtype before the norm reads it, as `residual + x` is in torch.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * dim + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    x32 = x32 / tl.sqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        normed = (weight * x32.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
        gate = tl.load(gate_ptr + token * stride_gate_token + head * stride_gate_head + cols, mask=mask,
                       other=0.0).to(tl.float32)
        y = normed.to(tl.float32) * gate * tl.sigmoid(gate)
    else:
        y = x32 * (1.0 + weight)
    tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, token stride, head stride) of a [T, D] or [T, H, D] tensor with a contiguous last dim."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _launch(x, weight, eps, residual=None, gate=None):
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
    block = triton.next_power_of_2(dim)
    if tokens * heads:
        _norm_kernel[(tokens * heads,)](
            x, residual if residual is not None else x, weight, gate if gate is not None else x, out, residual_out,
            heads, stride_token, stride_head, residual.stride(0) if residual is not None else 0, *gate_strides, dim,
            eps, HAS_RESIDUAL=residual is not None, GATED=gate is not None, BLOCK_D=block,
            num_warps=max(1, min(8, block // 256)),
        )
    return out, residual_out


def rms_norm(x, weight, eps, residual=None):
    out, residual_out = _launch(x, weight, eps, residual=residual)
    return out if residual is None else (out, residual_out)


def gated_rms_norm(x, gate, weight, eps):
    return _launch(x, weight, eps, gate=gate)[0]
