"""hybridkv.kernels: Triton kernels for GDN decode/prefill, causal conv1d, paged attention and fused MoE, each with a
plain-torch reference of the same signature (`hybridkv.kernels.reference`).

The functions below dispatch: Triton for CUDA tensors, the reference otherwise. `HYBRIDKV_KERNELS=reference` forces
the reference, `HYBRIDKV_KERNELS=triton` forces Triton (on CPU that means the Triton interpreter, where every kernel
but fla's chunk stages inside `gdn_prefill` and `conv_gdn_prefill` runs). Pool layouts:
conv state `[slots, conv_dim, W-1]`, recurrent state `[slots, HV, V, K]`, `k_cache`/`v_cache`
`[num_blocks, block_size, Hkv, D]`; slot 0 and block 0 are null and never read or written.
"""

from __future__ import annotations

import importlib
import os

from hybridkv.errors import UserError

from . import reference

KERNEL_MODES = ("auto", "reference", "triton")


def _use_triton(tensor) -> bool:
    mode = os.environ.get("HYBRIDKV_KERNELS", "auto")
    if mode not in KERNEL_MODES:
        raise UserError(f"HYBRIDKV_KERNELS={mode!r} is not one of {', '.join(KERNEL_MODES)}; unset it or pick one")
    return mode == "triton" or (mode == "auto" and tensor.is_cuda)


def _impl(module: str, tensor):
    # Triton modules are imported on first use so CPU-only runs never need triton.
    return importlib.import_module(f"{__name__}.{module}") if _use_triton(tensor) else reference


def causal_conv1d_prefill(x, weight, conv_state, slot_ids, cu_seqlens):
    """x `[T, D]` (varlen, `cu_seqlens` `[N+1]`) -> SiLU(conv) `[T, D]`; history from and back to the slots."""
    return _impl("conv1d", x).causal_conv1d_prefill(x, weight, conv_state, slot_ids, cu_seqlens)


def causal_conv1d_decode(x, weight, conv_state, slot_ids):
    """x `[B, D]` -> SiLU(conv) `[B, D]`; each row's slot is shifted by one input in place."""
    return _impl("conv1d", x).causal_conv1d_decode(x, weight, conv_state, slot_ids)


def gdn_decode(qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, num_k_heads, head_k_dim, head_v_dim):
    """One gated delta-rule step per row with fused gating and q/k l2norm; state updated in place -> o `[B, HV, V]`."""
    return _impl("gdn", qkv).gdn_decode(
        qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, num_k_heads, head_k_dim, head_v_dim
    )


def gdn_prefill(
    qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
    cu_seqlens_cpu: list[int] | None = None,
):
    """Varlen gated delta rule from and back to the slots' states -> o `[T, HV, V]`; new slots must hold zeros."""
    return _impl("gdn", qkv).gdn_prefill(
        qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )


def conv_gdn_prefill(
    x, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
    head_v_dim, cu_seqlens_cpu: list[int] | None = None,
):
    """A GDN layer's varlen prefill from the raw projections x `[T, conv_dim]`: causal conv1d + SiLU, then the gated
    delta rule; the conv and recurrent states come from and go back to each sequence's slot -> o `[T, HV, V]`."""
    return _impl("gdn", x).conv_gdn_prefill(
        x, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
        head_v_dim, cu_seqlens_cpu=cu_seqlens_cpu,
    )


def fused_moe(hidden, w13, w2, topk_weights, topk_ids):
    """Routed experts' SwiGLU of hidden `[T, H]` (w13 `[E, 2I, H]`, w2 `[E, H, I]`), each choice scaled by its
    routing weight and summed over a token's k choices (topk_ids/topk_weights `[T, k]`) -> `[T, H]`."""
    return _impl("moe", hidden).fused_moe(hidden, w13, w2, topk_weights, topk_ids)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Store k/v `[T, Hkv, D]` at flat slots `slot_mapping` (int64, block * block_size + offset)."""
    return _impl("attention", k).write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k):
    """Causal GQA attention of q `[T, Hq, D]` over the paged K/V of each sequence -> o `[T, Hq, D]`."""
    return _impl("attention", q).paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k
    )


__all__ = [
    "KERNEL_MODES",
    "causal_conv1d_decode",
    "causal_conv1d_prefill",
    "conv_gdn_prefill",
    "fused_moe",
    "gdn_decode",
    "gdn_prefill",
    "paged_attention",
    "reference",
    "write_kv_cache",
]
