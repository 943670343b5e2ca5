"""The model's RMSNorms, fused: one Triton kernel per norm on CUDA, a plain-torch reference of the same signature
elsewhere (CPU runs and the tests that hold the kernel to it).

A decode step of the 4B model runs ~100 norms; unfused, each is ~8 elementwise kernels, which costs more than the
weights' memory traffic at small batch. Both forms round where transformers' Qwen3.5 rounds: the residual sum in the
activation dtype, the zero-centred norm `norm(x) * (1 + w)` in fp32, the gated norm's `w * norm(x)` in the
activation dtype before the SiLU gate. `HYBRIDKV_KERNELS=reference` forces the reference, as for `hybridkv.kernels`.
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


def rms_norm(x, weight, eps, residual=None):
    if _use_triton(x):
        from hybridkv.sidecar import norm_kernels

        return norm_kernels.rms_norm(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def gated_rms_norm(x, gate, weight, eps):
    if _use_triton(x):
        from hybridkv.sidecar import norm_kernels

        return norm_kernels.gated_rms_norm(x, gate, weight, eps)
    return gated_rms_norm_reference(x, gate, weight, eps)
