"""The model's elementwise steps, fused: one Triton kernel each on CUDA, a plain-torch reference of the same
signature elsewhere (CPU runs, and the tests that hold each kernel to its reference).

A decode step of the 4B model runs ~100 norms, 8 rotaries and 32 SwiGLU activations; unfused they are ~1,000 small
launches, which cost more than reading the weights at small batch. Both forms round where transformers' Qwen3.5
rounds: the residual sum in the activation dtype, the zero-centred norm `norm(x) * (1 + w)` in fp32, the gated
norm's `w * norm(x)` in the activation dtype before the SiLU gate, rotary products and SiLU in the activation dtype.
`HYBRIDKV_KERNELS=reference` forces the references, as it does for `hybridkv.kernels`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("HYBRIDKV_KERNELS", "auto") != "reference"


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_reference(x, weight, eps, residual=None):
    """Zero-centred RMSNorm over the last dim; with `residual`, normalises `x + residual` and returns it too."""
    if residual is not None:
        x = residual = residual + x
    normed = (_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)
    return normed if residual is None else (normed, residual)


def gated_rms_norm_reference(x, gate, weight, eps):
    """`(w * rmsnorm(x)) * silu(gate)` over the last dim (norm before gate, plain weight)."""
    normed = weight * _normalize(x, eps).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(positions, q, k, inv_freq, rotary_dim):
    """NeoX rotary of the first `rotary_dim` dims of q `[T, Hq, D]` and k `[T, Hkv, D]` at `positions` `[T]`."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)

    def rotate(x):
        rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passed), dim=-1)

    return rotate(q), rotate(k)


def silu_and_mul_reference(x):
    """SwiGLU over a merged `[gate | up]` projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _dispatch(name: str, reference, x, *args):
    if _use_triton(x):
        from hybridkv.kernels import elementwise as fused_kernels

        return getattr(fused_kernels, name)(x, *args)
    return reference(x, *args)


def rms_norm(x, weight, eps, residual=None):
    return _dispatch("rms_norm", rms_norm_reference, x, weight, eps, residual)


def gated_rms_norm(x, gate, weight, eps):
    return _dispatch("gated_rms_norm", gated_rms_norm_reference, x, gate, weight, eps)


def rotary(positions, q, k, inv_freq, rotary_dim):
    if _use_triton(q):
        from hybridkv.kernels import elementwise as fused_kernels

        return fused_kernels.rotary(positions, q, k, inv_freq, rotary_dim)
    return rotary_reference(positions, q, k, inv_freq, rotary_dim)


def silu_and_mul(x):
    return _dispatch("silu_and_mul", silu_and_mul_reference, x)
