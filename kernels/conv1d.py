"""Depthwise causal conv1d + SiLU in Triton over a pooled conv state `[slots, D, W-1]` (the last W-1 raw inputs,
oldest first; slot 0 null, never read or written, its rows' outputs are zeros)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import (cdiv, dependent_launch, early_release, next_power_of_2, release_after_wait, release_at_start,
                           wait_for_producer)

_BLOCK_TOKENS = 32
_BLOCK_CHANNELS = 256


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ids_ptr"])
def _conv1d_prefill_kernel(
    x_ptr, weight_ptr, state_ptr, slot_ids_ptr, cu_seqlens_ptr, token_seq_ptr, y_ptr,
    num_tokens, stride_x_row, stride_w_ch, stride_w_tap, stride_state_slot, stride_state_ch, stride_state_tap,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """The input loads do not depend on the per-token sequence lookups, so both are in flight at once; only a tile
    that holds one of a sequence's first W-1 tokens recomputes those rows with sequence bounds and slot history."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask_t = offs_t < num_tokens
    mask_d = offs_d < D
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for tap in tl.static_range(W):
        pos = offs_t - (W - 1) + tap
        x_val = tl.load(x_ptr + pos.to(tl.int64)[:, None] * stride_x_row + offs_d[None, :],
                        mask=(mask_t & (pos >= 0))[:, None] & mask_d[None, :], other=0.0)
        tap_weight = tl.load(weight_ptr + offs_d * stride_w_ch + tap * stride_w_tap, mask=mask_d, other=0.0)
        acc += x_val.to(tl.float32) * tap_weight.to(tl.float32)[None, :]
    seq = tl.load(token_seq_ptr + offs_t, mask=mask_t, other=0)
    start = tl.load(cu_seqlens_ptr + seq)
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    live = mask_t & (slot != 0)
    if tl.sum((live & (offs_t - start < W - 1)).to(tl.int32), 0) > 0:
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for tap in tl.static_range(W):
            pos = offs_t - (W - 1) + tap
            x_mask = (live & (pos >= start))[:, None] & mask_d[None, :]
            x_val = tl.load(x_ptr + pos.to(tl.int64)[:, None] * stride_x_row + offs_d[None, :], mask=x_mask,
                            other=0.0)
            history_mask = (live & (pos < start))[:, None] & mask_d[None, :]
            history_ptrs = (state_ptr + slot[:, None] * stride_state_slot + offs_d[None, :] * stride_state_ch
                            + (pos - start + W - 1)[:, None] * stride_state_tap)
            history = tl.load(history_ptrs, mask=history_mask, other=0.0)
            tap_weight = tl.load(weight_ptr + offs_d * stride_w_ch + tap * stride_w_tap, mask=mask_d, other=0.0)
            acc += (x_val.to(tl.float32) + history.to(tl.float32)) * tap_weight.to(tl.float32)[None, :]
    y = tl.where(live[:, None], acc * tl.sigmoid(acc), 0.0)
    y_ptrs = y_ptr + offs_t.to(tl.int64)[:, None] * D + offs_d[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])


@triton.jit(do_not_specialize_on_alignment=["slot_ids_ptr"])
def _conv1d_prefill_state_kernel(
    x_ptr, state_ptr, slot_ids_ptr, cu_seqlens_ptr, stride_x_row, stride_state_slot, stride_state_ch,
    stride_state_tap, D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
):
    """After the outputs are written: slot <- the last W-1 raw inputs of (history ++ chunk)."""
    seq = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    offs_w = tl.arange(0, BW)
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    pos = end - (W - 1) + offs_w
    in_chunk = pos >= start
    live = (offs_w < W - 1) & ((offs_w * 0 + slot) != 0)
    mask_d = offs_d < D
    x_val = tl.load(x_ptr + pos.to(tl.int64)[None, :] * stride_x_row + offs_d[:, None],
                    mask=mask_d[:, None] & (live & in_chunk)[None, :], other=0.0)
    state_base = state_ptr + slot * stride_state_slot + offs_d[:, None] * stride_state_ch
    history = tl.load(state_base + (pos - start + W - 1)[None, :] * stride_state_tap,
                      mask=mask_d[:, None] & (live & ~in_chunk)[None, :], other=0.0)
    new_state = x_val.to(state_ptr.dtype.element_ty) + history
    tl.store(state_base + offs_w[None, :] * stride_state_tap, new_state, mask=mask_d[:, None] & live[None, :])


def check_conv_inputs(x, weight, conv_state) -> torch.Tensor:
    """x with unit channel stride (copied only if needed), after checking the shapes agree."""
    if weight.shape[0] != x.shape[1] or tuple(conv_state.shape[1:]) != (x.shape[1], weight.shape[1] - 1):
        raise ValueError(
            f"x [T, {x.shape[1]}], weight [{x.shape[1]}, W] and conv_state [slots, {x.shape[1]}, W-1] disagree: "
            f"got weight {tuple(weight.shape)}, conv_state {tuple(conv_state.shape)}"
        )
    return x if x.stride(1) == 1 else x.contiguous()


def _token_sequences(cu_seqlens, num_tokens: int) -> torch.Tensor:
    """Each token's sequence index `[T]` int32, computed on the device (output_size given: no host sync)."""
    num_seqs = cu_seqlens.shape[0] - 1
    return torch.repeat_interleave(torch.arange(num_seqs, dtype=torch.int32, device=cu_seqlens.device),
                                   cu_seqlens[1:] - cu_seqlens[:-1], output_size=num_tokens)


def write_conv_history(x, conv_state, slot_ids, cu_seqlens, width: int) -> None:
    """Each slot <- the last W-1 raw inputs of (its history ++ its chunk of x). Launched after every kernel that
    reads the old history, so no program overwrites history another one still has to read."""
    channels = x.shape[1]
    _conv1d_prefill_state_kernel[(slot_ids.shape[0], cdiv(channels, _BLOCK_CHANNELS))](
        x, conv_state, slot_ids, cu_seqlens, x.stride(0), *conv_state.stride(), D=channels, W=width,
        BW=next_power_of_2(width - 1), BD=_BLOCK_CHANNELS, num_warps=4,
    )


def causal_conv1d_prefill(x, weight, conv_state, slot_ids, cu_seqlens):
    """Varlen causal conv1d + SiLU; history read from and the last W-1 raw inputs written back to each slot."""
    x = check_conv_inputs(x, weight, conv_state)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    y = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or slot_ids.shape[0] == 0:
        return y
    grid = (cdiv(num_tokens, _BLOCK_TOKENS), cdiv(channels, _BLOCK_CHANNELS))
    _conv1d_prefill_kernel[grid](
        x, weight, conv_state, slot_ids, cu_seqlens, _token_sequences(cu_seqlens, num_tokens), y, num_tokens,
        x.stride(0), weight.stride(0), weight.stride(1), *conv_state.stride(), D=channels, W=width,
        BT=_BLOCK_TOKENS, BD=_BLOCK_CHANNELS, num_warps=4,
    )
    write_conv_history(x, conv_state, slot_ids, cu_seqlens, width)
    return y


@triton.jit
def _conv1d_decode_kernel(
    x_ptr, weight_ptr, state_ptr, slot_ids_ptr, y_ptr, stride_x_row, stride_w_ch, stride_w_tap,
    stride_state_slot, stride_state_ch, stride_state_tap,
    D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_STATE: tl.constexpr, EARLY: tl.constexpr,
):
    """Launched dependently, the weights are read before the wait, the input after it, and the slot's history
    before it only with PREFETCH_STATE (no kernel before it in the step writes it)."""
    release_at_start(PDL, EARLY)
    row = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    offs_w = tl.arange(0, BW)
    mask_d = offs_d < D
    history_weight = tl.load(weight_ptr + offs_d[:, None] * stride_w_ch + offs_w[None, :] * stride_w_tap,
                             mask=mask_d[:, None] & (offs_w < W - 1)[None, :], other=0.0)
    newest_weight = tl.load(weight_ptr + offs_d * stride_w_ch + (W - 1) * stride_w_tap, mask=mask_d, other=0.0)
    if not PREFETCH_STATE:
        wait_for_producer(PDL)
    slot = tl.load(slot_ids_ptr + row).to(tl.int64)
    live = (offs_w < W - 1) & ((offs_w * 0 + slot) != 0)
    state_base = state_ptr + slot * stride_state_slot + offs_d[:, None] * stride_state_ch
    history = tl.load(state_base + offs_w[None, :] * stride_state_tap, mask=mask_d[:, None] & live[None, :],
                      other=0.0)
    # The history shifted by one (entry i + 1 in place i), read in the same pass as the history itself.
    shifted = tl.load(state_base + (offs_w + 1)[None, :] * stride_state_tap,
                      mask=mask_d[:, None] & (live & (offs_w + 1 < W - 1))[None, :], other=0.0)
    if PREFETCH_STATE:
        wait_for_producer(PDL)
    x_val = tl.load(x_ptr + row.to(tl.int64) * stride_x_row + offs_d, mask=mask_d, other=0.0)
    release_after_wait(PDL, EARLY)
    acc = tl.sum(history.to(tl.float32) * history_weight.to(tl.float32), 1)
    acc += x_val.to(tl.float32) * newest_weight.to(tl.float32)
    y = tl.where(slot != 0, acc * tl.sigmoid(acc), 0.0)
    tl.store(y_ptr + row.to(tl.int64) * D + offs_d, y.to(y_ptr.dtype.element_ty), mask=mask_d)
    # Shift by one: the last entry takes the new input.
    new_state = tl.where((offs_w == W - 2)[None, :], x_val.to(state_ptr.dtype.element_ty)[:, None], shifted)
    tl.store(state_base + offs_w[None, :] * stride_state_tap, new_state, mask=mask_d[:, None] & live[None, :])


def causal_conv1d_decode(x, weight, conv_state, slot_ids, prefetch_state: bool = False):
    """One step per row: y = SiLU(conv(history ++ x)); the slot's history shifts by one in place. `prefetch_state`:
    no kernel of the step before this one writes `conv_state` (launched dependently, the history is then read before
    waiting for them: the projection before may let this kernel start at its own start)."""
    x = check_conv_inputs(x, weight, conv_state)
    rows, channels = x.shape
    width = weight.shape[1]
    y = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    if rows:
        pdl = dependent_launch(x.device)
        _conv1d_decode_kernel[(rows, cdiv(channels, _BLOCK_CHANNELS))](
            x, weight, conv_state, slot_ids, y, x.stride(0), weight.stride(0), weight.stride(1),
            *conv_state.stride(), D=channels, W=width, BW=next_power_of_2(width - 1), BD=_BLOCK_CHANNELS, PDL=pdl,
            PREFETCH_STATE=prefetch_state, EARLY=early_release(x.device), num_warps=4, launch_pdl=pdl,
        )
    return y
