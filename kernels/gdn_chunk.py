"""Gated DeltaNet kernels in Triton: decode (one token per request, state updated in place in the pool) and varlen
prefill: one input pass that, for a whole layer, also runs the causal conv1d and sums the gates per chunk, then
fla's kkt-and-solve kernel, and either our WY-form pass and our chunk-state pass from its w and u or, with many
sequences and heads, the chunk-state pass that forms the WY values itself; both read and write each sequence's
state in the pool. Last, fla's output stage.

State pool `[slots, HV, V, K]` (V-first), float32 or bfloat16, slot 0 null. The kernels that write the pool in place
run with fixed launch configurations: an autotuner would re-run them and apply the update twice.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .conv1d import causal_conv1d_prefill, check_conv_inputs, write_conv_history
from .reference import L2NORM_EPS, SOFTPLUS_THRESHOLD, check_gdn_shapes
from .triton_utils import INTERPRETED, device_limits, find_sequence, search_steps

_EPS = tl.constexpr(L2NORM_EPS)
# fla's chunk stages take the gates' chunk sums in log2 units, scaled by its float32 1/ln 2.
RCP_LN2 = 1.4426950216
_RCP_LN2 = tl.constexpr(RCP_LN2)
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


# The input pass's register window: conv kernels up to this width run inside it.
MAX_FUSED_CONV_WIDTH = 4
_WINDOW = tl.constexpr(MAX_FUSED_CONV_WIDTH)


@triton.jit
def _tap_weight(weight_ptr, channels, mask_d, stride_w_ch, stride_w_tap, TAP: tl.constexpr, W: tl.constexpr):
    """Weight of window position TAP (0 = oldest of 4) as float32; zero where a narrower kernel has no tap."""
    if TAP >= _WINDOW - W:
        tap = TAP - (_WINDOW - W)
        return tl.load(weight_ptr + channels * stride_w_ch + tap * stride_w_tap, mask=mask_d, other=0.0).to(tl.float32)
    return tl.zeros(channels.shape, dtype=tl.float32)


@triton.jit
def _history_rows(x_ptr, state_ptr, slot, channels, mask_d, pos, start, stride_x_row, stride_state_slot,
                  stride_state_ch, stride_state_tap, W: tl.constexpr):
    """Raw input at position `pos` of a sequence that starts at `start`, for the program's heads: from x inside the
    chunk, else from the slot's conv history (zeros for the null slot and beyond the history)."""
    # Conditions as tiles: the interpreter rejects a scalar condition combined into a tile mask.
    pos_d = channels * 0 + pos
    entry = pos - start + W - 1
    from_x = tl.load(x_ptr + pos.to(tl.int64) * stride_x_row + channels, mask=mask_d & (pos_d >= start), other=0.0)
    from_state = tl.load(state_ptr + slot * stride_state_slot + channels * stride_state_ch + entry * stride_state_tap,
                         mask=mask_d & (pos_d < start) & (pos_d - start + W - 1 >= 0) & (pos_d * 0 + slot != 0),
                         other=0.0)
    return from_x.to(tl.float32) + from_state.to(tl.float32)


@triton.jit
def _store_input_rows(y, out_ptrs, row, mask_d, normalise, live, CONV: tl.constexpr):
    """SiLU (after the conv), the l2norm of q/k heads, zeros for the null slot; one token's row of each head stored."""
    if CONV:
        y = y * tl.sigmoid(y)
    y = y * tl.where(normalise, tl.rsqrt(tl.sum(y * y, 1) + _EPS)[:, None], 1.0)
    y = tl.where(live, y, 0.0)
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask_d & row)


@triton.jit(do_not_specialize=["num_tokens"])  # 1 would become a constant, not an int32 tensor
def _prefill_inputs_kernel(
    x_ptr, weight_ptr, conv_state_ptr, slot_ids_ptr, cu_seqlens_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    qkv_out_ptr, g_ptr, beta_ptr, num_tokens, num_seqs, num_search_steps, stride_x_row, stride_w_ch, stride_w_tap,
    stride_state_slot, stride_state_ch, stride_state_tap, stride_a_row, stride_b_row,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, CONV: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, HEADS: tl.constexpr, BD: tl.constexpr, GATE_CUMSUM: tl.constexpr,
):
    """HEADS consecutive heads (numbered q heads, then k heads, then v heads) over up to BLOCK_ROWS tokens of one
    sequence: SiLU(causal conv) of x when CONV, else x itself; q and k l2-normalised; stored to the q | k | v buffer
    (`[T, H, K]`, `[T, H, K]`, `[T, HV, V]` back to back). The program also writes g and beta (float32) of the v
    heads among its heads; with GATE_CUMSUM, g as fla's chunk stages take it: summed within the program's rows (one
    fla chunk) and scaled by 1/ln 2.

    Tokens go in order, four rows a step, and the conv window stays in registers: each input is read once. Rows of
    a null-slot sequence come out as zeros."""
    block = tl.program_id(1)
    # Sequence n owns blocks [cu[n] // BLOCK_ROWS + n, ...): one spare block per sequence keeps this exact.
    seq = find_sequence(cu_seqlens_ptr, num_seqs, num_search_steps, block, BLOCK_ROWS, 1)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    first = start + (block - (start // BLOCK_ROWS + seq)) * BLOCK_ROWS
    if first < end:
        last = tl.minimum(first + BLOCK_ROWS, end)
        slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
        live = slot != 0
        heads = tl.program_id(0) * HEADS + tl.arange(0, HEADS)
        in_v = heads >= 2 * H
        v_heads = heads - 2 * H
        offs_d = tl.arange(0, BD)
        # Per head: its first input channel, its width, and in the q | k | v buffer its region, the width of a
        # token's row there and its first column.
        channel0 = tl.where(in_v, 2 * H * K + v_heads * V, heads * K)
        mask_d = (heads < 2 * H + HV)[:, None] & (offs_d[None, :] < tl.where(in_v, V, K)[:, None])
        channels = channel0[:, None] + offs_d[None, :]
        total = num_tokens.to(tl.int64)
        region = tl.where(in_v, 2 * total * H * K, (heads // H) * total * H * K)
        head_row_width = tl.where(in_v, HV * V, H * K)
        first_column = tl.where(in_v, v_heads * V, (heads % H) * K)
        out_ptrs = qkv_out_ptr + (region + first.to(tl.int64) * head_row_width + first_column)[:, None] + offs_d
        row_width = head_row_width[:, None]
        normalise = (heads < 2 * H)[:, None]
        x_ptrs = x_ptr + first.to(tl.int64) * stride_x_row + channels
        if CONV:
            w0 = _tap_weight(weight_ptr, channels, mask_d, stride_w_ch, stride_w_tap, 0, W)
            w1 = _tap_weight(weight_ptr, channels, mask_d, stride_w_ch, stride_w_tap, 1, W)
            w2 = _tap_weight(weight_ptr, channels, mask_d, stride_w_ch, stride_w_tap, 2, W)
            w3 = _tap_weight(weight_ptr, channels, mask_d, stride_w_ch, stride_w_tap, 3, W)
            # h1, h2, h3: the raw inputs 1, 2 and 3 tokens before the current row.
            h3 = _history_rows(x_ptr, conv_state_ptr, slot, channels, mask_d, first - 3, start, stride_x_row,
                               stride_state_slot, stride_state_ch, stride_state_tap, W)
            h2 = _history_rows(x_ptr, conv_state_ptr, slot, channels, mask_d, first - 2, start, stride_x_row,
                               stride_state_slot, stride_state_ch, stride_state_tap, W)
            h1 = _history_rows(x_ptr, conv_state_ptr, slot, channels, mask_d, first - 1, start, stride_x_row,
                               stride_state_slot, stride_state_ch, stride_state_tap, W)
        for step in range(0, last - first, 4):
            rows_left = channels * 0 + (last - first - step)  # a tile, as in _history_rows
            xa = tl.load(x_ptrs + step * stride_x_row, mask=mask_d & (rows_left > 0), other=0.0)
            xb = tl.load(x_ptrs + (step + 1) * stride_x_row, mask=mask_d & (rows_left > 1), other=0.0)
            xc = tl.load(x_ptrs + (step + 2) * stride_x_row, mask=mask_d & (rows_left > 2), other=0.0)
            xd = tl.load(x_ptrs + (step + 3) * stride_x_row, mask=mask_d & (rows_left > 3), other=0.0)
            xa, xb, xc, xd = xa.to(tl.float32), xb.to(tl.float32), xc.to(tl.float32), xd.to(tl.float32)
            if CONV:
                ya = w0 * h3 + w1 * h2 + w2 * h1 + w3 * xa
                yb = w0 * h2 + w1 * h1 + w2 * xa + w3 * xb
                yc = w0 * h1 + w1 * xa + w2 * xb + w3 * xc
                yd = w0 * xa + w1 * xb + w2 * xc + w3 * xd
                h3, h2, h1 = xb, xc, xd
            else:
                ya, yb, yc, yd = xa, xb, xc, xd
            _store_input_rows(ya, out_ptrs + step * row_width, rows_left > 0, mask_d, normalise, live, CONV)
            _store_input_rows(yb, out_ptrs + (step + 1) * row_width, rows_left > 1, mask_d, normalise, live, CONV)
            _store_input_rows(yc, out_ptrs + (step + 2) * row_width, rows_left > 2, mask_d, normalise, live, CONV)
            _store_input_rows(yd, out_ptrs + (step + 3) * row_width, rows_left > 3, mask_d, normalise, live, CONV)
        if tl.program_id(0) * HEADS + HEADS > 2 * H:
            rows = first + tl.arange(0, BLOCK_ROWS)
            gate_heads = in_v & (heads < 2 * H + HV)
            gate_mask = (rows < last)[:, None] & gate_heads[None, :]
            g, beta = _gates(tl.load(a_ptr + rows[:, None] * stride_a_row + v_heads[None, :], mask=gate_mask,
                                     other=0.0),
                             tl.load(b_ptr + rows[:, None] * stride_b_row + v_heads[None, :], mask=gate_mask,
                                     other=0.0),
                             tl.load(A_log_ptr + v_heads, mask=gate_heads, other=0.0)[None, :],
                             tl.load(dt_bias_ptr + v_heads, mask=gate_heads, other=0.0)[None, :])
            if GATE_CUMSUM:
                g = tl.cumsum(g, 0) * _RCP_LN2  # fla's order: sum, then scale
            tl.store(g_ptr + rows[:, None] * HV + v_heads[None, :], g, mask=gate_mask)
            tl.store(beta_ptr + rows[:, None] * HV + v_heads[None, :], beta, mask=gate_mask)


def prefill_launch_config(head_dim: int) -> dict:
    """Tokens and heads per program, and warps, of the input pass (from a sweep on the H200)."""
    return {"block_rows": 64, "heads": 2, "num_warps": 2, "block_dim": triton.next_power_of_2(head_dim)}


def prepare_prefill_inputs(x, a, b, A_log, dt_bias, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
                           conv=None, config: dict | None = None, gate_cumsum: bool = False):
    """One pass over the tokens -> q, k l2-normalised `[T, H, K]` and v `[T, HV, V]` in x's dtype, g and beta
    `[T, HV]` in float32; rows of null-slot sequences are zeros. With `conv = (weight, conv_state)`, x is first
    run through the causal conv1d + SiLU with each sequence's history from its slot, which then holds the chunk's
    last W-1 raw inputs (W at most `MAX_FUSED_CONV_WIDTH`). With `gate_cumsum`, g comes as fla's chunk stages take
    it: summed within each 64-token chunk of a sequence, times `RCP_LN2`. `config` overrides
    `prefill_launch_config`."""
    rows, hv = x.shape[0], a.shape[1]
    key_elements, value_elements = rows * num_k_heads * head_k_dim, rows * hv * head_v_dim
    qkv_out = torch.empty(2 * key_elements + value_elements, dtype=x.dtype, device=x.device)
    q = qkv_out[:key_elements].view(rows, num_k_heads, head_k_dim)
    k = qkv_out[key_elements : 2 * key_elements].view(rows, num_k_heads, head_k_dim)
    v = qkv_out[2 * key_elements :].view(rows, hv, head_v_dim)
    g = torch.empty(rows, hv, dtype=torch.float32, device=x.device)
    beta = torch.empty_like(g)
    launch = prefill_launch_config(max(head_k_dim, head_v_dim))
    launch.update(config or {})
    if gate_cumsum and launch["block_rows"] != FLA_CHUNK_TOKENS:
        raise ValueError(f"chunk sums of the gates need {FLA_CHUNK_TOKENS} rows per program, "
                         f"got {launch['block_rows']}")
    num_seqs = slot_ids.shape[0]
    if rows == 0 or num_seqs == 0:
        return q, k, v, g, beta
    x = x if x.stride(1) == 1 else x.contiguous()
    if conv is None:
        weight = conv_state = x  # unused without the conv
        width, conv_strides = 1, (0, 0, 0)
    else:
        weight, conv_state = conv
        width, conv_strides = weight.shape[1], conv_state.stride()
        if width > MAX_FUSED_CONV_WIDTH:
            raise ValueError(f"the fused input pass takes conv kernels up to {MAX_FUSED_CONV_WIDTH} wide, got {width}")
    grid = (triton.cdiv(2 * num_k_heads + hv, launch["heads"]), rows // launch["block_rows"] + num_seqs)
    _prefill_inputs_kernel[grid](
        x, weight, conv_state, slot_ids, cu_seqlens, a, b, A_log, dt_bias, qkv_out, g, beta, rows, num_seqs,
        search_steps(num_seqs), x.stride(0), weight.stride(0), weight.stride(-1), *conv_strides, a.stride(0),
        b.stride(0), H=num_k_heads, HV=hv, K=head_k_dim, V=head_v_dim, W=width, CONV=conv is not None,
        BLOCK_ROWS=launch["block_rows"], HEADS=launch["heads"], BD=launch["block_dim"], GATE_CUMSUM=gate_cumsum,
        num_warps=launch["num_warps"],
    )
    if conv is not None:
        write_conv_history(x, conv_state, slot_ids, cu_seqlens, width)
    return q, k, v, g, beta


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


# Tokens per chunk of fla's chunk_gated_delta_rule (its default).
FLA_CHUNK_TOKENS = 64


@functools.lru_cache(maxsize=8)
def _fla_bounds(bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's `cu_seqlens` (int64), `chunk_indices` (sequence, chunk within it) and `chunk_offsets` (each sequence's
    first chunk) for these sequence bounds, built on the host and copied from pinned memory, so nothing waits for
    the device (fla derives them on the device, the indices through a blocking copy). Cached: every GDN layer of a
    step has the same bounds."""
    chunks = [-(-(bounds[n + 1] - bounds[n]) // FLA_CHUNK_TOKENS) for n in range(len(bounds) - 1)]
    indices = [(n, chunk) for n, count in enumerate(chunks) for chunk in range(count)]
    offsets = [0]
    for count in chunks:
        offsets.append(offsets[-1] + count)
    host = (torch.tensor(bounds, dtype=torch.long), torch.tensor(indices, dtype=torch.long).view(-1, 2),
            torch.tensor(offsets, dtype=torch.long))
    if device.type == "cuda":
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in host)
    return tuple(t.to(device) for t in host)


@triton.jit
def _state_block(pool_ptr, slot_ids_ptr, cu_seqlens_ptr, chunk_offsets_ptr, stride_pool_slot, HV: tl.constexpr,
                 V: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A state-pass program's block: (sequence, head, block of V rows) from the grid `(V blocks, sequences * HV)`.
    -> head, the sequence's token bounds and first chunk, the V offsets, the block's offsets and mask within a
    state `[HV, V, K]`, its pointers in the sequence's slot and their store mask (empty for the null slot), and the
    state read from there as float32 (zeros for the null slot, which is not read)."""
    seq = tl.program_id(1) // HV
    head = tl.program_id(1) % HV
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    first_chunk = tl.load(chunk_offsets_ptr + seq).to(tl.int64)
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    offs_v = tl.program_id(0) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_state = (offs_v[:, None] < V) & (offs_k[None, :] < K)
    state_offs = head * V * K + offs_v[:, None] * K + offs_k[None, :]
    live = (offs_v * 0 + slot) != 0  # a vector mask: the interpreter rejects a scalar one broadcast into it
    slot_ptrs = pool_ptr + slot * stride_pool_slot + state_offs
    slot_mask = mask_state & live[:, None]
    state = tl.load(slot_ptrs, mask=slot_mask, other=0.0).to(tl.float32)
    return head, start, end, first_chunk, offs_v, state_offs, mask_state, slot_ptrs, slot_mask, state


@triton.jit
def _chunk_start(h_ptr, state, state_offs, mask_state, start, end, first_chunk, chunk, offs_t, offs_v,
                 HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """Store h[chunk] = the state before the chunk; -> the chunk's rows, their mask, and the mask of its value tile."""
    rows = start + chunk * BT + offs_t
    mask_t = rows < end
    tl.store(h_ptr + (first_chunk + chunk) * HV * V * K + state_offs, state.to(h_ptr.dtype.element_ty),
             mask=mask_state)
    return rows, mask_t, mask_t[:, None] & (offs_v[None, :] < V)


@triton.jit
def _chunk_states_kernel(k_ptr, w_ptr, u_ptr, g_ptr, h_ptr, v_new_ptr, pool_ptr, slot_ids_ptr, cu_seqlens_ptr,
                         chunk_offsets_ptr, stride_pool_slot, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                         FLOAT32_DOT: tl.constexpr):
    """The state pass of the chunked gated delta rule for one (sequence, head, block of V rows), state in the pool,
    from the WY form's w and u.

    The state S `[V, K]` starts as the sequence's pool slot (zeros for the null slot, which is not read). For each
    BT-token chunk c: h[c] = S (the state before the chunk, for the output stage), v_new = u - w S^T, then
    S = S * 2^g_last + (v_new * 2^(g_last - g))^T k, g being the gates' chunk sums in log2 units. The final S goes
    back to the slot in the pool's dtype (not for the null slot)."""
    head, start, end, first_chunk, offs_v, state_offs, mask_state, slot_ptrs, slot_mask, state = _state_block(
        pool_ptr, slot_ids_ptr, cu_seqlens_ptr, chunk_offsets_ptr, stride_pool_slot, HV, V, K, BK, BV)
    offs_k = tl.arange(0, BK)
    offs_t = tl.arange(0, BT)
    k_head = head // (HV // H)
    for chunk in range(tl.cdiv(end - start, BT)):
        rows, mask_t, mask_tv = _chunk_start(h_ptr, state, state_offs, mask_state, start, end, first_chunk, chunk,
                                             offs_t, offs_v, HV, V, K, BT)
        w = tl.load(w_ptr + rows[:, None] * HV * K + head * K + offs_k[None, :],
                    mask=mask_t[:, None] & (offs_k[None, :] < K), other=0.0)
        u = tl.load(u_ptr + rows[:, None] * HV * V + head * V + offs_v[None, :], mask=mask_tv, other=0.0)
        state_operand = state.to(w.dtype)
        if FLOAT32_DOT:
            w, state_operand = w.to(tl.float32), state_operand.to(tl.float32)
        v_new = u.to(tl.float32) - tl.dot(w, tl.trans(state_operand))
        tl.store(v_new_ptr + rows[:, None] * HV * V + head * V + offs_v[None, :],
                 v_new.to(v_new_ptr.dtype.element_ty), mask=mask_tv)
        g = tl.load(g_ptr + rows * HV + head, mask=mask_t, other=0.0)
        g_last = tl.load(g_ptr + (tl.minimum(start + chunk * BT + BT, end) - 1) * HV + head)
        v_new = (v_new * tl.where(mask_t, tl.exp2(g_last - g), 0.0)[:, None]).to(k_ptr.dtype.element_ty)
        k_rows_t = tl.load(k_ptr + rows[None, :] * H * K + k_head * K + offs_k[:, None],
                           mask=mask_t[None, :] & (offs_k[:, None] < K), other=0.0)
        if FLOAT32_DOT:
            k_rows_t, v_new = k_rows_t.to(tl.float32), v_new.to(tl.float32)
        state = state * tl.exp2(g_last) + tl.trans(tl.dot(k_rows_t, v_new))
    tl.store(slot_ptrs, state.to(pool_ptr.dtype.element_ty), mask=slot_mask)


@triton.jit
def _folded_chunk_states_kernel(k_ptr, v_ptr, a_ptr, beta_ptr, g_ptr, h_ptr, v_new_ptr, pool_ptr, slot_ids_ptr,
                                cu_seqlens_ptr, chunk_offsets_ptr, stride_pool_slot, H: tl.constexpr,
                                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                                BV: tl.constexpr, BT: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    """The state pass as `_chunk_states_kernel`, with the WY form folded in: from v, beta and fla's solved A (the
    chunk's (I + strictly-lower(beta k k^T decay))^-1, lower triangle read) instead of w and u,
    v_new = A (beta * (v - 2^g * k S^T)), which is u - w S^T for u = A beta v and w = A beta 2^g k. One more matrix
    product per chunk on the state's path, and no w or u in memory."""
    head, start, end, first_chunk, offs_v, state_offs, mask_state, slot_ptrs, slot_mask, state = _state_block(
        pool_ptr, slot_ids_ptr, cu_seqlens_ptr, chunk_offsets_ptr, stride_pool_slot, HV, V, K, BK, BV)
    offs_k = tl.arange(0, BK)
    offs_t = tl.arange(0, BT)
    lower = offs_t[None, :] <= offs_t[:, None]
    k_head = head // (HV // H)
    for chunk in range(tl.cdiv(end - start, BT)):
        rows, mask_t, mask_tv = _chunk_start(h_ptr, state, state_offs, mask_state, start, end, first_chunk, chunk,
                                             offs_t, offs_v, HV, V, K, BT)
        k_rows = tl.load(k_ptr + rows[:, None] * H * K + k_head * K + offs_k[None, :],
                         mask=mask_t[:, None] & (offs_k[None, :] < K), other=0.0)
        v = tl.load(v_ptr + rows[:, None] * HV * V + head * V + offs_v[None, :], mask=mask_tv, other=0.0)
        a = tl.load(a_ptr + rows[:, None] * HV * BT + head * BT + offs_t[None, :], mask=mask_t[:, None] & lower,
                    other=0.0)
        beta = tl.load(beta_ptr + rows * HV + head, mask=mask_t, other=0.0)
        g = tl.load(g_ptr + rows * HV + head, mask=mask_t, other=0.0)
        g_last = tl.load(g_ptr + (tl.minimum(start + chunk * BT + BT, end) - 1) * HV + head)
        state_operand = state.to(k_rows.dtype)
        if FLOAT32_DOT:
            k_rows, state_operand, a = k_rows.to(tl.float32), state_operand.to(tl.float32), a.to(tl.float32)
        known = tl.dot(k_rows, tl.trans(state_operand))  # [BT, BV]: what S already maps each key to
        x = (beta[:, None] * (v.to(tl.float32) - tl.exp2(g)[:, None] * known)).to(a.dtype)
        v_new = tl.dot(a, x)
        tl.store(v_new_ptr + rows[:, None] * HV * V + head * V + offs_v[None, :],
                 v_new.to(v_new_ptr.dtype.element_ty), mask=mask_tv)
        v_new = (v_new * tl.where(mask_t, tl.exp2(g_last - g), 0.0)[:, None]).to(k_rows.dtype)
        state = state * tl.exp2(g_last) + tl.trans(tl.dot(tl.trans(k_rows), v_new))
    tl.store(slot_ptrs, state.to(pool_ptr.dtype.element_ty), mask=slot_mask)


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
    block = max(16, min(32, triton.next_power_of_2(max(head_k_dim, head_v_dim))))
    return {"block": block, "num_warps": 2, "num_stages": 3}


def wy_form(k, v, A, beta, g_cumsum, bounds, config: dict | None = None):
    """The WY form of every chunk from fla's solved A: k `[T, H, K]`, v `[T, HV, V]`, A `[T, HV, 64]` from
    `_fla_solve` (lower triangles read, so it needs no zero fill), beta `[T, HV]`, g_cumsum `[T, HV]` (log2 chunk
    sums), bounds = `_fla_bounds(...)`. -> w `[T, HV, K]` and u `[T, HV, V]` in k's dtype, for `chunk_states`."""
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


def folds_wy_form(sequences: int, num_v_heads: int, head_v_dim: int, multiprocessors: int) -> bool:
    """Whether the layer takes the folded state pass (`folded_chunk_states` on fla's solved A) rather than
    `wy_form` and `chunk_states`. The folded pass moves far fewer bytes but puts a third matrix product on
    each chunk's serial path: it wins once its 64-row programs outnumber the multiprocessors, where bandwidth
    bounds the pass, and loses below, where one chunk's latency does (measured on the H200,
    docs/performance.md)."""
    return sequences * num_v_heads * triton.cdiv(head_v_dim, 64) > multiprocessors


def chunk_state_launch_config(sequences: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, element_bytes: int,
                              multiprocessors: int, shared_memory_bytes: int) -> dict:
    """V rows per program, warps and pipeline stages of the state pass from w and u, from sweeps on the H200
    (docs/performance.md). Each program walks its sequence's chunks one after another, so with no more programs than
    multiprocessors the pass is bound by one chunk's latency: 32-row blocks and a 4-deep pipeline. With more, 64-row
    blocks halve the programs; beyond one wave of those, a 2-deep pipeline (less shared memory) lets two programs
    share a multiprocessor. The depth is capped so that each stage's w, k and u tiles (`element_bytes` each) and
    the transposed state fit in `shared_memory_bytes`."""
    narrow = max(16, min(32, triton.next_power_of_2(head_v_dim)))
    if sequences * num_v_heads * triton.cdiv(head_v_dim, narrow) <= multiprocessors:
        block_v, stages = narrow, 4
    else:
        block_v = max(16, min(64, triton.next_power_of_2(head_v_dim)))
        stages = 3 if sequences * num_v_heads * triton.cdiv(head_v_dim, block_v) <= multiprocessors else 2
    block_k = _block_k(head_k_dim)
    return _fitted(block_v, stages, block_k, 2 * block_k + block_v, element_bytes, shared_memory_bytes)


def folded_chunk_state_launch_config(head_k_dim: int, head_v_dim: int, element_bytes: int,
                                     shared_memory_bytes: int) -> dict:
    """Launch configuration of the folded state pass, which runs where its programs outnumber the multiprocessors
    (`folds_wy_form`): 64-row blocks, 4 warps and a 2-deep pipeline (sweeps on the H200, docs/performance.md),
    capped so each stage's k, v and A tiles and the transposed state fit in `shared_memory_bytes`."""
    block_v = max(16, min(64, triton.next_power_of_2(head_v_dim)))
    block_k = _block_k(head_k_dim)
    return _fitted(block_v, 2, block_k, block_k + block_v + FLA_CHUNK_TOKENS, element_bytes, shared_memory_bytes)


def _block_k(head_k_dim: int) -> int:
    """The state passes' K tile: the whole head, padded to a power of two."""
    return max(16, triton.next_power_of_2(head_k_dim))


def _fitted(block_v: int, stages: int, block_k: int, tile_columns: int, element_bytes: int,
            shared_memory_bytes: int) -> dict:
    """{block_v, num_warps 4, num_stages}: `stages` at most, as many as fit in shared memory next to the transposed
    state, each stage holding a chunk's tiles of `tile_columns` columns."""
    per_stage = FLA_CHUNK_TOKENS * tile_columns * element_bytes
    fitting = (shared_memory_bytes - block_v * block_k * 4) // per_stage
    return {"block_v": block_v, "num_warps": 4, "num_stages": max(1, min(stages, fitting))}


def _state_pass_outputs(k, v_like, chunks: int, hv: int, v_dim: int, k_dim: int):
    """h `[chunks, HV, V, K]` and v_new shaped as `v_like`, both in k's dtype."""
    return (torch.empty(chunks, hv, v_dim, k_dim, dtype=k.dtype, device=k.device),
            torch.empty(v_like.shape, dtype=k.dtype, device=k.device))


def chunk_states(k, w, u, g_cumsum, ssm_state, slot_ids, bounds, config: dict | None = None):
    """The chunk-state pass straight from and back to the pool: k `[T, H, K]`, w `[T, HV, K]` and u `[T, HV, V]`
    from `wy_form`, g_cumsum `[T, HV]` (log2 chunk sums), bounds = `_fla_bounds(...)`. Each sequence
    starts from its slot and leaves its final state there; the null slot is neither read nor written.
    -> h `[chunks, HV, V, K]` (the state before each chunk, in k's dtype) and v_new `[T, HV, V]`."""
    cu_seqlens, chunk_indices, chunk_offsets = bounds
    hv, v_dim, k_dim = ssm_state.shape[1:]
    sequences = slot_ids.shape[0]
    launch = chunk_state_launch_config(sequences, hv, k_dim, v_dim, w.element_size(), *device_limits(k.device))
    launch.update(config or {})
    h, v_new = _state_pass_outputs(k, u, chunk_indices.shape[0], hv, v_dim, k_dim)
    if sequences:
        _chunk_states_kernel[(triton.cdiv(v_dim, launch["block_v"]), sequences * hv)](
            k, w, u, g_cumsum, h, v_new, ssm_state, slot_ids, cu_seqlens, chunk_offsets, ssm_state.stride(0),
            H=k.shape[1], HV=hv, K=k_dim, V=v_dim, BK=_block_k(k_dim), BV=launch["block_v"],
            BT=FLA_CHUNK_TOKENS, FLOAT32_DOT=INTERPRETED, num_warps=launch["num_warps"],
            num_stages=launch["num_stages"],
        )
    return h, v_new


def folded_chunk_states(k, v, A, beta, g_cumsum, ssm_state, slot_ids, bounds, config: dict | None = None):
    """The chunk-state pass with the WY form folded in, straight from and back to the pool: k `[T, H, K]`, v
    `[T, HV, V]`, beta `[T, HV]`, A `[T, HV, 64]` from `_fla_solve` (lower triangles read), g_cumsum `[T, HV]`
    (log2 chunk sums), bounds = `_fla_bounds(...)`. Slots as in `chunk_states`, and the same h and v_new."""
    cu_seqlens, chunk_indices, chunk_offsets = bounds
    hv, v_dim, k_dim = ssm_state.shape[1:]
    sequences = slot_ids.shape[0]
    _, shared_memory_bytes = device_limits(k.device)
    launch = folded_chunk_state_launch_config(k_dim, v_dim, k.element_size(), shared_memory_bytes)
    launch.update(config or {})
    h, v_new = _state_pass_outputs(k, v, chunk_indices.shape[0], hv, v_dim, k_dim)
    if sequences:
        _folded_chunk_states_kernel[(triton.cdiv(v_dim, launch["block_v"]), sequences * hv)](
            k, v, A, beta, g_cumsum, h, v_new, ssm_state, slot_ids, cu_seqlens, chunk_offsets, ssm_state.stride(0),
            H=k.shape[1], HV=hv, K=k_dim, V=v_dim, BK=_block_k(k_dim), BV=launch["block_v"],
            BT=FLA_CHUNK_TOKENS, FLOAT32_DOT=INTERPRETED, num_warps=launch["num_warps"],
            num_stages=launch["num_stages"],
        )
    return h, v_new


def _fla_solve(k, g_cumsum, beta, bounds):
    """fla's fused kkt-and-solve kernel: A `[T, HV, 64]`, each chunk's (I + strictly-lower(beta k k^T decay))^-1.
    Only the lower triangles are written; `wy_form` and `folded_chunk_states` read no more, so A is not zero-filled
    first (fla's own intra stage zero-fills it before the solve and forms w and u after it)."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel

    cu_seqlens, chunk_indices, _ = bounds
    tokens, num_k_heads, k_dim = k.shape
    hv = beta.shape[1]
    A = torch.empty(1, tokens, hv, FLA_CHUNK_TOKENS, dtype=k.dtype, device=k.device)
    chunk_gated_delta_rule_fwd_kkt_solve_kernel[(chunk_indices.shape[0], hv)](
        k=k[None], g=g_cumsum[None], beta=beta[None], A=A, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        T=tokens, H=num_k_heads, HV=hv, K=k_dim, BT=FLA_CHUNK_TOKENS, BC=16,
    )
    return A[0]


def _fla_output(q, k, v_new, h, g_cumsum, scale: float, bounds):
    """fla's output stage: o `[T, HV, V]` from the states before each chunk (V-first) and the new values."""
    from fla.ops.common.chunk_o import chunk_fwd_o

    cu_seqlens, chunk_indices, _ = bounds
    o = chunk_fwd_o(q=q[None], k=k[None], v=v_new[None], h=h[None], g=g_cumsum[None], scale=scale,
                    state_v_first=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                    chunk_size=FLA_CHUNK_TOKENS)
    return o[0].to(q.dtype)


def _chunk_through_pool(q, k, v, g_cumsum, beta, ssm_state, slot_ids, cu_seqlens, cu_seqlens_cpu, head_k_dim: int):
    """The chunked gated delta rule on prepared inputs: fla's kkt-and-solve kernel, then the WY form and the state
    pass from it or, with many sequences and heads, the folded state pass (`folds_wy_form`), either reading each
    sequence's state from its slot and writing the final state back (no dense copy of the states), and fla's
    output stage. Rows of null-slot sequences come out as zeros."""
    bounds = _fla_bounds(tuple(cu_seqlens.tolist() if cu_seqlens_cpu is None else cu_seqlens_cpu), q.device)
    A = _fla_solve(k, g_cumsum, beta, bounds)
    if folds_wy_form(slot_ids.shape[0], ssm_state.shape[1], ssm_state.shape[2], device_limits(q.device)[0]):
        h, v_new = folded_chunk_states(k, v, A, beta, g_cumsum, ssm_state, slot_ids, bounds)
        del A
    else:
        w, u = wy_form(k, v, A, beta, g_cumsum, bounds)
        del A
        h, v_new = chunk_states(k, w, u, g_cumsum, ssm_state, slot_ids, bounds)
        del w, u
    o = _fla_output(q, k, v_new, h, g_cumsum, head_k_dim**-0.5, bounds)
    zero_null_sequences(o, slot_ids, cu_seqlens)
    return o


def gdn_prefill(qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
                cu_seqlens_cpu: list[int] | None = None):
    """Varlen prefill of already convolved qkv: one input pass, then the chunked rule with the states read from and
    written back to the pool (`_chunk_through_pool`).
    New slots must hold zeros. o `[T, HV, V]`."""
    check_gdn_shapes(qkv, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    _require_state_layout(ssm_state)
    if qkv.shape[0] == 0:
        return torch.empty(0, ssm_state.shape[1], head_v_dim, dtype=qkv.dtype, device=qkv.device)
    q, k, v, g, beta = prepare_prefill_inputs(qkv, a, b, A_log, dt_bias, slot_ids, cu_seqlens, num_k_heads,
                                              head_k_dim, head_v_dim, gate_cumsum=True)
    return _chunk_through_pool(q, k, v, g, beta, ssm_state, slot_ids, cu_seqlens, cu_seqlens_cpu, head_k_dim)


def conv_gdn_prefill(x, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads,
                     head_k_dim, head_v_dim, cu_seqlens_cpu: list[int] | None = None):
    """A GDN layer's varlen prefill from the raw (pre-conv) projections: the causal conv1d + SiLU, the q/k l2norm,
    the q/k/v split and the gates in one pass, then the chunked rule as in `gdn_prefill`. Both the conv and
    the recurrent state are read from and written back to each sequence's slot (conv kernels wider than
    `MAX_FUSED_CONV_WIDTH` take the separate conv kernel first). o `[T, HV, V]`."""
    x = check_conv_inputs(x, conv_weight, conv_state)
    check_gdn_shapes(x, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    _require_state_layout(ssm_state)
    if x.shape[0] == 0:
        return torch.empty(0, ssm_state.shape[1], head_v_dim, dtype=x.dtype, device=x.device)
    if conv_weight.shape[1] > MAX_FUSED_CONV_WIDTH:
        mixed = causal_conv1d_prefill(x, conv_weight, conv_state, slot_ids, cu_seqlens)
        return gdn_prefill(mixed, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
                           head_v_dim, cu_seqlens_cpu=cu_seqlens_cpu)
    q, k, v, g, beta = prepare_prefill_inputs(x, a, b, A_log, dt_bias, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
                                              head_v_dim, conv=(conv_weight, conv_state), gate_cumsum=True)
    return _chunk_through_pool(q, k, v, g, beta, ssm_state, slot_ids, cu_seqlens, cu_seqlens_cpu, head_k_dim)
