"""Gated DeltaNet decode in Triton: one token per request, fused gating and q/k l2norm, each request's state
updated in place in its pool slot (`gdn_common` states the pool layout; the null slot's rows come out as zeros)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gdn_common import EPS, gates, require_state_layout
from .reference import check_gdn_shapes
from .triton_utils import (cdiv, dependent_launch, early_release, next_power_of_2, release_after_wait, release_at_start,
                           wait_for_producer)


@triton.jit
def _gdn_decode_kernel(
    qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, slot_ids_ptr, o_ptr,
    stride_qkv_row, stride_a_row, stride_b_row, stride_state_slot, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_STATE: tl.constexpr, EARLY: tl.constexpr,
):
    """Launched dependently, the gate parameters are read before the wait, the row's projections after it, and the
    slot's state before it only with PREFETCH_STATE (no kernel before it in the step writes it)."""
    release_at_start(PDL, EARLY)
    row_head = tl.program_id(0)
    row = row_head // HV
    head = row_head % HV
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_v = offs_v < V
    mask_k = offs_k < K
    o_ptrs = o_ptr + row_head * V + offs_v
    A_log = tl.load(A_log_ptr + head)
    dt_bias = tl.load(dt_bias_ptr + head)
    if not PREFETCH_STATE:
        wait_for_producer(PDL)
    slot = tl.load(slot_ids_ptr + row).to(tl.int64)
    if slot == 0:
        if PREFETCH_STATE:
            wait_for_producer(PDL)
        release_after_wait(PDL, EARLY)
        tl.store(o_ptrs, tl.zeros([BV], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=mask_v)
    else:
        state_ptrs = state_ptr + slot * stride_state_slot + head * V * K + offs_v[:, None] * K + offs_k[None, :]
        mask_state = mask_v[:, None] & mask_k[None, :]
        state = tl.load(state_ptrs, mask=mask_state, other=0.0).to(tl.float32)
        if PREFETCH_STATE:
            wait_for_producer(PDL)
        qkv_row = qkv_ptr + row.to(tl.int64) * stride_qkv_row
        k_head = head // (HV // H)
        q = tl.load(qkv_row + k_head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(qkv_row + H * K + k_head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(qkv_row + 2 * H * K + head * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_a_row + head)
        b = tl.load(b_ptr + row * stride_b_row + head)
        release_after_wait(PDL, EARLY)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + EPS) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + EPS)
        g, beta = gates(a, b, A_log, dt_bias)
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[None, :], 1)) * beta
        state = state + delta[:, None] * k[None, :]
        o = tl.sum(state * q[None, :], 1)
        tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_state)
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def decode_launch_config(rows: int, num_v_heads: int, head_v_dim: int) -> tuple[int, int]:
    """(block_v, num_warps), from a sweep on the H200: one warp per program, 8-row V tiles while the batch is small
    (more programs in flight), 32-row tiles for large batches (fewer programs to schedule)."""
    block_v = 8 if rows * num_v_heads <= 8192 else 32
    return min(block_v, next_power_of_2(head_v_dim)), 1


def gdn_decode(qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, num_k_heads, head_k_dim, head_v_dim,
               block_v: int | None = None, num_warps: int | None = None, prefetch_state: bool = False):
    """One gated delta-rule step per row; `ssm_state[slot_ids[i]]` is updated in place; o `[B, HV, V]`.
    `prefetch_state`: no kernel of the step before this one writes `ssm_state` (launched dependently, the state is
    then read before waiting for them: the conv before may let this kernel start at its own start).

    `block_v`/`num_warps` override the launch configuration (benchmarks sweep them).
    """
    check_gdn_shapes(qkv, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    require_state_layout(ssm_state)
    rows, hv = qkv.shape[0], ssm_state.shape[1]
    o = torch.empty(rows, hv, head_v_dim, dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return o
    default_block_v, default_warps = decode_launch_config(rows, hv, head_v_dim)
    block_v = block_v or default_block_v
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    grid = (rows * hv, cdiv(head_v_dim, block_v))
    pdl = dependent_launch(qkv.device)
    _gdn_decode_kernel[grid](
        qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, o,
        qkv.stride(0), a.stride(0), b.stride(0), ssm_state.stride(0), head_k_dim**-0.5,
        H=num_k_heads, HV=hv, K=head_k_dim, V=head_v_dim, BK=next_power_of_2(head_k_dim), BV=block_v, PDL=pdl,
        PREFETCH_STATE=prefetch_state, EARLY=early_release(qkv.device),
        num_warps=num_warps or default_warps, launch_pdl=pdl,
    )
    return o
