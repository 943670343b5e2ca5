"""Gated DeltaNet kernels in Triton: decode (one token per request, state updated in place in the pool) and varlen
prefill (fla's chunk kernel between a fused input-preparation pass and a gather/scatter of the pooled states).

State pool `[slots, HV, V, K]` (V-first), float32 or bfloat16, slot 0 null. The kernels that write the pool in place
run with fixed launch configurations: an autotuner would re-run them and apply the update twice.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .reference import L2NORM_EPS, SOFTPLUS_THRESHOLD, check_gdn_shapes

_EPS = tl.constexpr(L2NORM_EPS)
_THRESHOLD = tl.constexpr(SOFTPLUS_THRESHOLD)


def _require_state_layout(ssm_state: torch.Tensor) -> None:
    hv, v, k = ssm_state.shape[1:]
    if ssm_state.stride()[1:] != (v * k, k, 1):
        raise ValueError("ssm_state must be contiguous within a slot ([slots, HV, V, K] with unit stride along K)")


@triton.jit
def _gates(a, b, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), in float32."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    softplus = tl.where(x > _THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, _THRESHOLD))))
    return -tl.exp(A_log.to(tl.float32)) * softplus, tl.sigmoid(b.to(tl.float32))


@triton.jit
def _l2norm_heads(src_ptr, dst_ptr, offsets, mask):
    """Each row of a `[heads, K]` tile divided by its L2 norm, stored to `dst_ptr + offsets`."""
    x = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, 1) + _EPS)[:, None]
    tl.store(dst_ptr + offsets, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gdn_decode_kernel(
    qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, slot_ids_ptr, o_ptr,
    stride_qkv_row, stride_a_row, stride_b_row, stride_state_slot, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    row_head = tl.program_id(0)
    row = row_head // HV
    head = row_head % HV
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_v = offs_v < V
    mask_k = offs_k < K
    o_ptrs = o_ptr + row_head * V + offs_v
    slot = tl.load(slot_ids_ptr + row).to(tl.int64)
    if slot == 0:
        tl.store(o_ptrs, tl.zeros([BV], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=mask_v)
    else:
        qkv_row = qkv_ptr + row.to(tl.int64) * stride_qkv_row
        k_head = head // (HV // H)
        q = tl.load(qkv_row + k_head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(qkv_row + H * K + k_head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(qkv_row + 2 * H * K + head * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + _EPS) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + _EPS)
        g, beta = _gates(tl.load(a_ptr + row * stride_a_row + head), tl.load(b_ptr + row * stride_b_row + head),
                         tl.load(A_log_ptr + head), tl.load(dt_bias_ptr + head))
        state_ptrs = state_ptr + slot * stride_state_slot + head * V * K + offs_v[:, None] * K + offs_k[None, :]
        mask_state = mask_v[:, None] & mask_k[None, :]
        state = tl.load(state_ptrs, mask=mask_state, other=0.0).to(tl.float32) * tl.exp(g)
        delta = (v - tl.sum(state * k[None, :], 1)) * beta
        state = state + delta[:, None] * k[None, :]
        o = tl.sum(state * q[None, :], 1)
        tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_state)
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def decode_launch_config(rows: int, num_v_heads: int, head_v_dim: int) -> tuple[int, int]:
    """(block_v, num_warps), from a sweep on the H200: one warp per program, 8-row V tiles while the batch is small
    (more programs in flight), 32-row tiles for large batches (fewer programs to schedule)."""
    block_v = 8 if rows * num_v_heads <= 8192 else 32
    return min(block_v, triton.next_power_of_2(head_v_dim)), 1


def gdn_decode(qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, num_k_heads, head_k_dim, head_v_dim,
               block_v: int | None = None, num_warps: int | None = None):
    """One gated delta-rule step per row; `ssm_state[slot_ids[i]]` is updated in place; o `[B, HV, V]`.

    `block_v`/`num_warps` override the launch configuration (benchmarks sweep them).
    """
    check_gdn_shapes(qkv, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    _require_state_layout(ssm_state)
    rows, hv = qkv.shape[0], ssm_state.shape[1]
    o = torch.empty(rows, hv, head_v_dim, dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return o
    default_block_v, default_warps = decode_launch_config(rows, hv, head_v_dim)
    block_v = block_v or default_block_v
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    grid = (rows * hv, triton.cdiv(head_v_dim, block_v))
    _gdn_decode_kernel[grid](
        qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, o,
        qkv.stride(0), a.stride(0), b.stride(0), ssm_state.stride(0), head_k_dim**-0.5,
        H=num_k_heads, HV=hv, K=head_k_dim, V=head_v_dim, BK=triton.next_power_of_2(head_k_dim), BV=block_v,
        num_warps=num_warps or default_warps,
    )
    return o


@triton.jit
def _gdn_prefill_inputs_kernel(
    qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    stride_qkv_row, stride_a_row, stride_b_row,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
    BVALUES: tl.constexpr, BHV: tl.constexpr,
):
    """One token: l2-normalised q and k `[H, K]`, a contiguous copy of v `[HV*V]`, and g, beta `[HV]` in float32."""
    row = tl.program_id(0).to(tl.int64)
    qkv_row = qkv_ptr + row * stride_qkv_row
    offs_h = tl.arange(0, BH)
    offs_k = tl.arange(0, BK)
    mask_qk = (offs_h[:, None] < H) & (offs_k[None, :] < K)
    head_offsets = offs_h[:, None] * K + offs_k[None, :]
    _l2norm_heads(qkv_row, q_ptr + row * H * K, head_offsets, mask_qk)
    _l2norm_heads(qkv_row + H * K, k_ptr + row * H * K, head_offsets, mask_qk)
    offs_values = tl.arange(0, BVALUES)
    mask_values = offs_values < HV * V
    values = tl.load(qkv_row + 2 * H * K + offs_values, mask=mask_values)
    tl.store(v_ptr + row * HV * V + offs_values, values, mask=mask_values)
    offs_hv = tl.arange(0, BHV)
    mask_hv = offs_hv < HV
    g, beta = _gates(
        tl.load(a_ptr + row * stride_a_row + offs_hv, mask=mask_hv, other=0.0),
        tl.load(b_ptr + row * stride_b_row + offs_hv, mask=mask_hv, other=0.0),
        tl.load(A_log_ptr + offs_hv, mask=mask_hv, other=0.0),
        tl.load(dt_bias_ptr + offs_hv, mask=mask_hv, other=0.0),
    )
    tl.store(g_ptr + row * HV + offs_hv, g, mask=mask_hv)
    tl.store(beta_ptr + row * HV + offs_hv, beta, mask=mask_hv)


def prepare_prefill_inputs(qkv, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim):
    """One pass over the tokens: q, k l2-normalised `[T, H, K]` and v `[T, HV, V]` in qkv's dtype, g and beta
    `[T, HV]` in float32."""
    rows = qkv.shape[0]
    hv = (qkv.shape[1] - 2 * num_k_heads * head_k_dim) // head_v_dim
    q = torch.empty(rows, num_k_heads, head_k_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    v = torch.empty(rows, hv, head_v_dim, dtype=qkv.dtype, device=qkv.device)
    g = torch.empty(rows, hv, dtype=torch.float32, device=qkv.device)
    beta = torch.empty_like(g)
    if rows:
        qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
        _gdn_prefill_inputs_kernel[(rows,)](
            qkv, a, b, A_log, dt_bias, q, k, v, g, beta, qkv.stride(0), a.stride(0), b.stride(0),
            H=num_k_heads, HV=hv, K=head_k_dim, V=head_v_dim, BH=triton.next_power_of_2(num_k_heads),
            BK=triton.next_power_of_2(head_k_dim), BVALUES=triton.next_power_of_2(hv * head_v_dim),
            BHV=triton.next_power_of_2(hv), num_warps=8,
        )
    return q, k, v, g, beta


@triton.jit
def _gather_states_kernel(pool_ptr, slot_ids_ptr, dense_ptr, stride_pool_slot, STATE_ELEMENTS: tl.constexpr,
                          BLOCK: tl.constexpr):
    """dense[n] = pool[slot_ids[n]] in float32, zeros for the null slot (which is not read)."""
    seq = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < STATE_ELEMENTS
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    live = (offs * 0 + slot) != 0  # a vector mask: the interpreter rejects a scalar one broadcast into it
    values = tl.load(pool_ptr + slot * stride_pool_slot + offs, mask=mask & live, other=0.0)
    tl.store(dense_ptr + seq.to(tl.int64) * STATE_ELEMENTS + offs, values.to(tl.float32), mask=mask)


@triton.jit
def _scatter_states_kernel(dense_ptr, slot_ids_ptr, pool_ptr, stride_pool_slot, STATE_ELEMENTS: tl.constexpr,
                           BLOCK: tl.constexpr):
    """pool[slot_ids[n]] = dense[n] in the pool's dtype; the null slot is not written."""
    seq = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    mask = (offs < STATE_ELEMENTS) & ((offs * 0 + slot) != 0)
    values = tl.load(dense_ptr + seq.to(tl.int64) * STATE_ELEMENTS + offs, mask=mask)
    tl.store(pool_ptr + slot * stride_pool_slot + offs, values.to(pool_ptr.dtype.element_ty), mask=mask)


_STATE_COPY_BLOCK = 4096


def gather_states(ssm_state, slot_ids):
    """`[N, HV, V, K]` float32 copy of the named slots (zeros for slot 0)."""
    dense = torch.empty(slot_ids.shape[0], *ssm_state.shape[1:], dtype=torch.float32, device=ssm_state.device)
    elements = math.prod(ssm_state.shape[1:])
    if slot_ids.shape[0]:
        grid = (slot_ids.shape[0], triton.cdiv(elements, _STATE_COPY_BLOCK))
        _gather_states_kernel[grid](ssm_state, slot_ids, dense, ssm_state.stride(0), STATE_ELEMENTS=elements,
                                    BLOCK=_STATE_COPY_BLOCK)
    return dense


def scatter_states(dense, slot_ids, ssm_state):
    """Write `dense[n]` to `ssm_state[slot_ids[n]]`, skipping slot 0."""
    elements = math.prod(ssm_state.shape[1:])
    if dense.shape[0]:
        grid = (slot_ids.shape[0], triton.cdiv(elements, _STATE_COPY_BLOCK))
        _scatter_states_kernel[grid](dense, slot_ids, ssm_state, ssm_state.stride(0), STATE_ELEMENTS=elements,
                                     BLOCK=_STATE_COPY_BLOCK)


@triton.jit
def _zero_null_sequences_kernel(o_ptr, slot_ids_ptr, cu_seqlens_ptr, ROW_ELEMENTS: tl.constexpr,
                                BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Zero the output rows of every sequence on the null slot; other sequences cost one load."""
    seq = tl.program_id(0)
    if tl.load(slot_ids_ptr + seq) == 0:
        start = tl.load(cu_seqlens_ptr + seq)
        end = tl.load(cu_seqlens_ptr + seq + 1)
        offs = tl.arange(0, BLOCK)
        offs_rows = tl.arange(0, BLOCK_ROWS)
        zeros = tl.zeros([BLOCK_ROWS, BLOCK], dtype=tl.float32).to(o_ptr.dtype.element_ty)
        for first in range(start, end, BLOCK_ROWS):
            rows = first + offs_rows
            ptrs = o_ptr + rows.to(tl.int64)[:, None] * ROW_ELEMENTS + offs[None, :]
            tl.store(ptrs, zeros, mask=(rows[:, None] < end) & (offs[None, :] < ROW_ELEMENTS))


def zero_null_sequences(o, slot_ids, cu_seqlens):
    """o `[T, ...]` contiguous: rows of sequences whose slot is 0 become zeros."""
    row_elements = math.prod(o.shape[1:])
    if slot_ids.shape[0] and row_elements:
        _zero_null_sequences_kernel[(slot_ids.shape[0],)](
            o, slot_ids, cu_seqlens, ROW_ELEMENTS=row_elements, BLOCK_ROWS=4,
            BLOCK=triton.next_power_of_2(row_elements),
        )


def gdn_prefill(qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
                cu_seqlens_cpu: list[int] | None = None):
    """Varlen prefill through fla's `chunk_gated_delta_rule`, initial states gathered from the pool by slot and final
    states scattered back (cast to the pool's dtype). New slots must hold zeros. o `[T, HV, V]`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    check_gdn_shapes(qkv, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    _require_state_layout(ssm_state)
    if qkv.shape[0] == 0:
        return torch.empty(0, ssm_state.shape[1], head_v_dim, dtype=qkv.dtype, device=qkv.device)
    q, k, v, g, beta = prepare_prefill_inputs(qkv, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim)
    initial = gather_states(ssm_state, slot_ids)
    bounds_cpu = None if cu_seqlens_cpu is None else torch.tensor(cu_seqlens_cpu, dtype=torch.long)
    o, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=head_k_dim**-0.5, initial_state=initial,
        output_final_state=True, state_v_first=True, cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=bounds_cpu,
    )
    scatter_states(final, slot_ids, ssm_state)
    o = o[0]
    zero_null_sequences(o, slot_ids, cu_seqlens)
    return o
