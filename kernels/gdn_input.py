"""The GDN prefill's input pass in Triton: for a whole layer, one pass over the tokens that runs the causal conv1d +
SiLU (history from each sequence's slot), l2-normalises q and k, splits q | k | v and forms the gates, summed per
chunk as fla's chunk stages take them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .conv1d import write_conv_history
from .fla_adapter import FLA_CHUNK_TOKENS, RCP_LN2
from .gdn_common import EPS, gates
from .triton_utils import cdiv, find_sequence, next_power_of_2, search_steps

_RCP_LN2 = tl.constexpr(RCP_LN2)

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
    y = y * tl.where(normalise, tl.rsqrt(tl.sum(y * y, 1) + EPS)[:, None], 1.0)
    y = tl.where(live, y, 0.0)
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask_d & row)


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "num_search_steps"],  # one compile for every batch
            do_not_specialize_on_alignment=["slot_ids_ptr"])
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
            g, beta = gates(tl.load(a_ptr + rows[:, None] * stride_a_row + v_heads[None, :], mask=gate_mask,
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
    return {"block_rows": 64, "heads": 2, "num_warps": 2, "block_dim": next_power_of_2(head_dim)}


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
    grid = (cdiv(2 * num_k_heads + hv, launch["heads"]), rows // launch["block_rows"] + num_seqs)
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
