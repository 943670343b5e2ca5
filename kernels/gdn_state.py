"""The GDN prefill's chunk-state passes in Triton, straight from and back to the state pool: one from the WY form's
w and u, one that forms the WY values itself from fla's solved A (`folds_wy_form` picks between them). Both write
h, the state before each chunk, and v_new for fla's output stage; both run with fixed launch configurations
(`gdn_common`). Both can also store the float32 running state at chosen chunk starts into a second pool (`capture`):
prefix caching's checkpoints inside a prefill chunk, without ending the chunk there."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fla_adapter import FLA_CHUNK_TOKENS
from .triton_utils import INTERPRETED, cdiv, device_limits, next_power_of_2


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
                 capture_ptr, capture_pool_ptr, stride_capture_slot, capture_count,
                 HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """Store h[chunk] = the state before the chunk, and the same state unrounded into the capture pool's slot
    `capture[chunk]` where that is not -1 (`capture_count` 0: no capture table, which is then not read);
    -> the chunk's rows, their mask, and the mask of its value tile."""
    rows = start + chunk * BT + offs_t
    mask_t = rows < end
    tl.store(h_ptr + (first_chunk + chunk) * HV * V * K + state_offs, state.to(h_ptr.dtype.element_ty),
             mask=mask_state)
    # Without a table the first entry of whatever was passed is read (never past its end) and ignored.
    capture_slot = tl.load(capture_ptr + tl.where(capture_count > 0, first_chunk + chunk, 0)).to(tl.int64)
    capture_slot = tl.where(capture_count > 0, capture_slot, -1)
    captured = (offs_v * 0 + capture_slot) >= 0  # a vector mask, as `_state_block`'s
    tl.store(capture_pool_ptr + tl.maximum(capture_slot, 0) * stride_capture_slot + state_offs,
             state.to(capture_pool_ptr.dtype.element_ty), mask=mask_state & captured[:, None])
    return rows, mask_t, mask_t[:, None] & (offs_v[None, :] < V)


@triton.jit(do_not_specialize=["capture_count"],
            do_not_specialize_on_alignment=["slot_ids_ptr", "capture_ptr", "capture_pool_ptr"])
def _chunk_states_kernel(k_ptr, w_ptr, u_ptr, g_ptr, h_ptr, v_new_ptr, pool_ptr, slot_ids_ptr, cu_seqlens_ptr,
                         chunk_offsets_ptr, stride_pool_slot, capture_ptr, capture_pool_ptr, stride_capture_slot,
                         capture_count, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                         FLOAT32_DOT: tl.constexpr):
    """The state pass of the chunked gated delta rule for one (sequence, head, block of V rows), state in the pool,
    from the WY form's w and u.

    The state S `[V, K]` starts as the sequence's pool slot (zeros for the null slot, which is not read). For each
    BT-token chunk c: h[c] = S (the state before the chunk, for the output stage), v_new = u - w S^T, then
    S = S * 2^g_last + (v_new * 2^(g_last - g))^T k, g being the gates' chunk sums in log2 units. The final S goes
    back to the slot in the pool's dtype (not for the null slot); S before chunk c also goes to the capture pool's
    slot `capture[first chunk + c]` where that is not -1."""
    head, start, end, first_chunk, offs_v, state_offs, mask_state, slot_ptrs, slot_mask, state = _state_block(
        pool_ptr, slot_ids_ptr, cu_seqlens_ptr, chunk_offsets_ptr, stride_pool_slot, HV, V, K, BK, BV)
    offs_k = tl.arange(0, BK)
    offs_t = tl.arange(0, BT)
    k_head = head // (HV // H)
    for chunk in range(tl.cdiv(end - start, BT)):
        rows, mask_t, mask_tv = _chunk_start(h_ptr, state, state_offs, mask_state, start, end, first_chunk, chunk,
                                             offs_t, offs_v, capture_ptr, capture_pool_ptr, stride_capture_slot,
                                             capture_count, HV, V, K, BT)
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


@triton.jit(do_not_specialize=["capture_count"],
            do_not_specialize_on_alignment=["slot_ids_ptr", "capture_ptr", "capture_pool_ptr"])
def _folded_chunk_states_kernel(k_ptr, v_ptr, a_ptr, beta_ptr, g_ptr, h_ptr, v_new_ptr, pool_ptr, slot_ids_ptr,
                                cu_seqlens_ptr, chunk_offsets_ptr, stride_pool_slot, capture_ptr, capture_pool_ptr,
                                stride_capture_slot, capture_count, H: tl.constexpr,
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
                                             offs_t, offs_v, capture_ptr, capture_pool_ptr, stride_capture_slot,
                                             capture_count, HV, V, K, BT)
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


def folds_wy_form(sequences: int, num_v_heads: int, head_v_dim: int, multiprocessors: int) -> bool:
    """Whether the layer takes the folded state pass (`folded_chunk_states` on fla's solved A) rather than
    `gdn_wy.wy_form` and `chunk_states`. The folded pass moves far fewer bytes but puts a third matrix product on
    each chunk's serial path: it wins once its 64-row programs outnumber the multiprocessors, where bandwidth
    bounds the pass, and loses below, where one chunk's latency does (measured on the H200,
    docs/performance.md)."""
    return sequences * num_v_heads * cdiv(head_v_dim, 64) > multiprocessors


def chunk_state_launch_config(sequences: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, element_bytes: int,
                              multiprocessors: int, shared_memory_bytes: int) -> dict:
    """V rows per program, warps and pipeline stages of the state pass from w and u, from sweeps on the H200
    (docs/performance.md). Each program walks its sequence's chunks one after another, so with no more programs than
    multiprocessors the pass is bound by one chunk's latency: 32-row blocks and a 4-deep pipeline. With more, 64-row
    blocks halve the programs; beyond one wave of those, a 2-deep pipeline (less shared memory) lets two programs
    share a multiprocessor. The depth is capped so that each stage's w, k and u tiles (`element_bytes` each) and
    the transposed state fit in `shared_memory_bytes`."""
    narrow = max(16, min(32, next_power_of_2(head_v_dim)))
    if sequences * num_v_heads * cdiv(head_v_dim, narrow) <= multiprocessors:
        block_v, stages = narrow, 4
    else:
        block_v = max(16, min(64, next_power_of_2(head_v_dim)))
        stages = 3 if sequences * num_v_heads * cdiv(head_v_dim, block_v) <= multiprocessors else 2
    block_k = _block_k(head_k_dim)
    return _fitted(block_v, stages, block_k, 2 * block_k + block_v, element_bytes, shared_memory_bytes)


def folded_chunk_state_launch_config(head_k_dim: int, head_v_dim: int, element_bytes: int,
                                     shared_memory_bytes: int) -> dict:
    """Launch configuration of the folded state pass, which runs where its programs outnumber the multiprocessors
    (`folds_wy_form`): 64-row blocks, 4 warps and a 2-deep pipeline (sweeps on the H200, docs/performance.md),
    capped so each stage's k, v and A tiles and the transposed state fit in `shared_memory_bytes`."""
    block_v = max(16, min(64, next_power_of_2(head_v_dim)))
    block_k = _block_k(head_k_dim)
    return _fitted(block_v, 2, block_k, block_k + block_v + FLA_CHUNK_TOKENS, element_bytes, shared_memory_bytes)


def _block_k(head_k_dim: int) -> int:
    """The state passes' K tile: the whole head, padded to a power of two."""
    return max(16, next_power_of_2(head_k_dim))


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


def _capture_args(capture, ssm_state, slot_ids, chunks: int) -> tuple:
    """The kernels' (table, pool, pool slot stride, table length) for `capture` = (chunk_slots, pool): int32
    `[chunks]` (a checkpoint slot of `pool` per chunk of the step, -1 for none) and a pool laid out as the state
    pool. Without one, the state pool and the slot ids stand in (same dtypes, so the same compiled kernel)."""
    if capture is None:
        return slot_ids, ssm_state, ssm_state.stride(0), 0
    chunk_slots, pool = capture
    if chunk_slots.dtype != torch.int32 or tuple(chunk_slots.shape) != (chunks,):
        raise ValueError(f"capture chunk slots must be int32 [{chunks}] (one per chunk), got "
                         f"{chunk_slots.dtype} {tuple(chunk_slots.shape)}")
    if pool.dtype != ssm_state.dtype or pool.shape[1:] != ssm_state.shape[1:] or pool.stride() != ssm_state.stride():
        raise ValueError(f"the capture pool {pool.dtype} {tuple(pool.shape)} must be laid out as the state pool "
                         f"{ssm_state.dtype} {tuple(ssm_state.shape)}")
    return chunk_slots, pool, pool.stride(0), chunks


def chunk_states(k, w, u, g_cumsum, ssm_state, slot_ids, bounds, config: dict | None = None, capture=None):
    """The chunk-state pass straight from and back to the pool: k `[T, H, K]`, w `[T, HV, K]` and u `[T, HV, V]`
    from `gdn_wy.wy_form`, g_cumsum `[T, HV]` (log2 chunk sums), bounds = `fla_adapter.chunk_bounds(...)`. Each sequence
    starts from its slot and leaves its final state there; the null slot is neither read nor written. With `capture`
    (`_capture_args`), the state before each chosen chunk is also stored in its checkpoint slot.
    -> h `[chunks, HV, V, K]` (the state before each chunk, in k's dtype) and v_new `[T, HV, V]`."""
    cu_seqlens, chunk_indices, chunk_offsets = bounds
    hv, v_dim, k_dim = ssm_state.shape[1:]
    sequences = slot_ids.shape[0]
    launch = chunk_state_launch_config(sequences, hv, k_dim, v_dim, w.element_size(), *device_limits(k.device))
    launch.update(config or {})
    h, v_new = _state_pass_outputs(k, u, chunk_indices.shape[0], hv, v_dim, k_dim)
    if sequences:
        _chunk_states_kernel[(cdiv(v_dim, launch["block_v"]), sequences * hv)](
            k, w, u, g_cumsum, h, v_new, ssm_state, slot_ids, cu_seqlens, chunk_offsets, ssm_state.stride(0),
            *_capture_args(capture, ssm_state, slot_ids, chunk_indices.shape[0]),
            H=k.shape[1], HV=hv, K=k_dim, V=v_dim, BK=_block_k(k_dim), BV=launch["block_v"],
            BT=FLA_CHUNK_TOKENS, FLOAT32_DOT=INTERPRETED, num_warps=launch["num_warps"],
            num_stages=launch["num_stages"],
        )
    return h, v_new


def folded_chunk_states(k, v, A, beta, g_cumsum, ssm_state, slot_ids, bounds, config: dict | None = None,
                        capture=None):
    """The chunk-state pass with the WY form folded in, straight from and back to the pool: k `[T, H, K]`, v
    `[T, HV, V]`, beta `[T, HV]`, A `[T, HV, 64]` from `fla_adapter.kkt_solve` (lower triangles read), g_cumsum
    `[T, HV]` (log2 chunk sums), bounds = `fla_adapter.chunk_bounds(...)`. Slots and `capture` as in `chunk_states`, and
    the same h and v_new."""
    cu_seqlens, chunk_indices, chunk_offsets = bounds
    hv, v_dim, k_dim = ssm_state.shape[1:]
    sequences = slot_ids.shape[0]
    _, shared_memory_bytes = device_limits(k.device)
    launch = folded_chunk_state_launch_config(k_dim, v_dim, k.element_size(), shared_memory_bytes)
    launch.update(config or {})
    h, v_new = _state_pass_outputs(k, v, chunk_indices.shape[0], hv, v_dim, k_dim)
    if sequences:
        _folded_chunk_states_kernel[(cdiv(v_dim, launch["block_v"]), sequences * hv)](
            k, v, A, beta, g_cumsum, h, v_new, ssm_state, slot_ids, cu_seqlens, chunk_offsets, ssm_state.stride(0),
            *_capture_args(capture, ssm_state, slot_ids, chunk_indices.shape[0]),
            H=k.shape[1], HV=hv, K=k_dim, V=v_dim, BK=_block_k(k_dim), BV=launch["block_v"],
            BT=FLA_CHUNK_TOKENS, FLOAT32_DOT=INTERPRETED, num_warps=launch["num_warps"],
            num_stages=launch["num_stages"],
        )
    return h, v_new
