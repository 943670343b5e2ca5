"""The WY form of the GDN prefill's chunks in Triton, from fla's solved A: w and u for `gdn_state.chunk_states`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fla_adapter import FLA_CHUNK_TOKENS
from .triton_utils import INTERPRETED, next_power_of_2


@triton.jit
def _wy_form_kernel(k_ptr, v_ptr, a_ptr, beta_ptr, g_ptr, w_ptr, u_ptr, cu_seqlens_ptr, chunk_indices_ptr,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, BT: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    """The WY form of one (chunk, head): u = A (beta * v), w = A (beta * 2^g * k), A being the chunk's solved
    (I + strictly-lower(beta k k^T decay))^-1 of which only the lower triangle is read. The grid is flat, heads
    fastest, so the heads that share a key head run side by side and read its k from L2."""
    head = tl.program_id(0) % HV
    chunk = tl.program_id(0) // HV
    seq = tl.load(chunk_indices_ptr + 2 * chunk)
    start = tl.load(cu_seqlens_ptr + seq) + tl.load(chunk_indices_ptr + 2 * chunk + 1) * BT
    end = tl.load(cu_seqlens_ptr + seq + 1)
    offs_t = tl.arange(0, BT)
    rows = start + offs_t
    mask_t = rows < end
    a = tl.load(a_ptr + rows[:, None] * HV * BT + head * BT + offs_t[None, :], mask=mask_t[:, None], other=0.0)
    a = tl.where(offs_t[None, :] <= offs_t[:, None], a, tl.zeros_like(a))  # above the diagonal is unwritten
    beta = tl.load(beta_ptr + rows * HV + head, mask=mask_t, other=0.0)
    if FLOAT32_DOT:
        a = a.to(tl.float32)
    for block in range(tl.cdiv(V, BV)):
        offs_v = block * BV + tl.arange(0, BV)
        mask = mask_t[:, None] & (offs_v[None, :] < V)
        v = tl.load(v_ptr + rows[:, None] * HV * V + head * V + offs_v[None, :], mask=mask, other=0.0)
        u = tl.dot(a, (v * beta[:, None]).to(a.dtype))
        tl.store(u_ptr + rows[:, None] * HV * V + head * V + offs_v[None, :], u.to(u_ptr.dtype.element_ty),
                 mask=mask)
    key_scale = beta * tl.exp2(tl.load(g_ptr + rows * HV + head, mask=mask_t, other=0.0))
    k_head = head // (HV // H)
    for block in range(tl.cdiv(K, BK)):
        offs_k = block * BK + tl.arange(0, BK)
        mask = mask_t[:, None] & (offs_k[None, :] < K)
        k = tl.load(k_ptr + rows[:, None] * H * K + k_head * K + offs_k[None, :], mask=mask, other=0.0)
        w = tl.dot(a, (k * key_scale[:, None]).to(a.dtype))
        tl.store(w_ptr + rows[:, None] * HV * K + head * K + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=mask)


def wy_form_launch_config(head_k_dim: int, head_v_dim: int) -> dict:
    """Column block, warps and pipeline stages of the WY-form pass: 32 columns of k or v at a time, 2 warps and a
    3-deep pipeline, the fastest configuration or within 2 % of it in every case of the sweep on the H200 (16-, 32-
    and 64-column blocks, 2 and 4 warps, 2-4 stages; docs/performance.md)."""
    block = max(16, min(32, next_power_of_2(max(head_k_dim, head_v_dim))))
    return {"block": block, "num_warps": 2, "num_stages": 3}


def wy_form(k, v, A, beta, g_cumsum, bounds, config: dict | None = None):
    """The WY form of every chunk from fla's solved A: k `[T, H, K]`, v `[T, HV, V]`, A `[T, HV, 64]` from
    `fla_adapter.kkt_solve` (lower triangles read, so it needs no zero fill), beta `[T, HV]`, g_cumsum `[T, HV]`
    (log2 chunk sums), bounds = `fla_adapter.chunk_bounds(...)`. -> w `[T, HV, K]` and u `[T, HV, V]` in k's dtype,
    for `gdn_state.chunk_states`."""
    cu_seqlens, chunk_indices, _ = bounds
    tokens, hv, v_dim = v.shape
    k_dim = k.shape[2]
    launch = wy_form_launch_config(k_dim, v_dim)
    launch.update(config or {})
    w = torch.empty(tokens, hv, k_dim, dtype=k.dtype, device=k.device)
    u = torch.empty(tokens, hv, v_dim, dtype=k.dtype, device=k.device)
    if chunk_indices.shape[0]:
        _wy_form_kernel[(chunk_indices.shape[0] * hv,)](
            k, v, A, beta, g_cumsum, w, u, cu_seqlens, chunk_indices, H=k.shape[1], HV=hv, K=k_dim, V=v_dim,
            BK=launch["block"], BV=launch["block"], BT=FLA_CHUNK_TOKENS, FLOAT32_DOT=INTERPRETED,
            num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        )
    return w, u
