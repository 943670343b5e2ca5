"""The GDN layer's varlen prefill in Triton, stage by stage: the input pass (`gdn_input`: for a whole layer, also
the causal conv1d and the gates' chunk sums), then fla's kkt-and-solve kernel, and either our WY-form pass
(`gdn_wy`) and our chunk-state pass from its w and u or, with many sequences and heads, the chunk-state pass that
forms the WY values itself (`gdn_state`); both read and write each sequence's state in the pool. Last, fla's output
stage. Every call into fla goes through `fla_adapter`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import fla_adapter
from .conv1d import causal_conv1d_prefill, check_conv_inputs
from .gdn_common import require_state_layout
from .gdn_input import MAX_FUSED_CONV_WIDTH, prepare_prefill_inputs
from .gdn_state import chunk_states, folded_chunk_states, folds_wy_form
from .gdn_wy import wy_form
from .reference import check_gdn_shapes
from .triton_utils import device_limits, next_power_of_2


@triton.jit(do_not_specialize_on_alignment=["slot_ids_ptr"])
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
            BLOCK=next_power_of_2(row_elements),
        )


def _chunk_through_pool(q, k, v, g_cumsum, beta, ssm_state, slot_ids, cu_seqlens, cu_seqlens_cpu, head_k_dim: int,
                        capture=None, null_slots: bool = True):
    """The chunked gated delta rule on prepared inputs: fla's kkt-and-solve kernel, then the WY form and the state
    pass from it or, with many sequences and heads, the folded state pass (`folds_wy_form`), either reading each
    sequence's state from its slot and writing the final state back (no dense copy of the states; `capture` as in
    `gdn_state.chunk_states`), and fla's output stage. Rows of null-slot sequences come out as zeros (with
    `null_slots=False` the caller says there are none, and no launch zeroes them)."""
    host_bounds = cu_seqlens.tolist() if cu_seqlens_cpu is None else cu_seqlens_cpu
    bounds = fla_adapter.chunk_bounds(tuple(host_bounds), q.device)
    A = fla_adapter.kkt_solve(k, g_cumsum, beta, bounds)
    if folds_wy_form(slot_ids.shape[0], ssm_state.shape[1], ssm_state.shape[2], device_limits(q.device)[0]):
        h, v_new = folded_chunk_states(k, v, A, beta, g_cumsum, ssm_state, slot_ids, bounds, capture=capture)
        del A
    else:
        w, u = wy_form(k, v, A, beta, g_cumsum, bounds)
        del A
        h, v_new = chunk_states(k, w, u, g_cumsum, ssm_state, slot_ids, bounds, capture=capture)
        del w, u
    o = fla_adapter.output_stage(q, k, v_new, h, g_cumsum, head_k_dim**-0.5, bounds)
    if null_slots:
        zero_null_sequences(o, slot_ids, cu_seqlens)
    return o


def gdn_prefill(qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
                cu_seqlens_cpu: list[int] | None = None, capture=None, null_slots: bool = True):
    """Varlen prefill of already convolved qkv: one input pass, then the chunked rule with the states read from and
    written back to the pool (`_chunk_through_pool`; `null_slots` as there).
    New slots must hold zeros. o `[T, HV, V]`."""
    check_gdn_shapes(qkv, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    require_state_layout(ssm_state)
    if qkv.shape[0] == 0:
        return torch.empty(0, ssm_state.shape[1], head_v_dim, dtype=qkv.dtype, device=qkv.device)
    q, k, v, g, beta = prepare_prefill_inputs(qkv, a, b, A_log, dt_bias, slot_ids, cu_seqlens, num_k_heads,
                                              head_k_dim, head_v_dim, gate_cumsum=True)
    return _chunk_through_pool(q, k, v, g, beta, ssm_state, slot_ids, cu_seqlens, cu_seqlens_cpu, head_k_dim,
                               capture, null_slots)


def conv_gdn_prefill(x, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads,
                     head_k_dim, head_v_dim, cu_seqlens_cpu: list[int] | None = None, capture=None,
                     null_slots: bool = True):
    """A GDN layer's varlen prefill from the raw (pre-conv) projections: the causal conv1d + SiLU, the q/k l2norm,
    the q/k/v split and the gates in one pass, then the chunked rule as in `gdn_prefill`. Both the conv and
    the recurrent state are read from and written back to each sequence's slot (conv kernels wider than
    `MAX_FUSED_CONV_WIDTH` take the separate conv kernel first). `null_slots=False`: no sequence is on the null
    slot, so no launch zeroes their rows. o `[T, HV, V]`."""
    x = check_conv_inputs(x, conv_weight, conv_state)
    check_gdn_shapes(x, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    require_state_layout(ssm_state)
    if x.shape[0] == 0:
        return torch.empty(0, ssm_state.shape[1], head_v_dim, dtype=x.dtype, device=x.device)
    if conv_weight.shape[1] > MAX_FUSED_CONV_WIDTH:
        mixed = causal_conv1d_prefill(x, conv_weight, conv_state, slot_ids, cu_seqlens)
        return gdn_prefill(mixed, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
                           head_v_dim, cu_seqlens_cpu=cu_seqlens_cpu, capture=capture, null_slots=null_slots)
    q, k, v, g, beta = prepare_prefill_inputs(x, a, b, A_log, dt_bias, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
                                              head_v_dim, conv=(conv_weight, conv_state), gate_cumsum=True)
    return _chunk_through_pool(q, k, v, g, beta, ssm_state, slot_ids, cu_seqlens, cu_seqlens_cpu, head_k_dim,
                               capture, null_slots)
