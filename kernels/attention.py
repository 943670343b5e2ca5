"""Paged attention in Triton: one kernel for varlen prefill with a cached prefix and for batched decode, over
`k_cache`/`v_cache` `[num_blocks, block_size, Hkv, D]` addressed through block tables (block 0 null).

A program takes BLOCK_Q query tokens of one sequence times the GQA group of one KV head (BLOCK_M rows, so decode
still feeds the matrix units) and walks that KV head's pages once with an online softmax. Small decode batches split
each sequence's keys into segments (flash-decoding) and merge them in a second kernel, so the grid covers the GPU.

The pools hold `k / k_scale` and `v / v_scale` (one static scale per layer; 1.0 leaves 16/32-bit pools as they
were). An fp8 pool (float8_e4m3fn) saturates at ±448: `write_kv_cache` quantizes; the attention kernel widens each
page tile to q's dtype (exact: every e4m3 value is a bfloat16 and a float16) and folds k_scale into the softmax scale
and v_scale into the output, which is the same as dequantizing every element.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hybridkv.sizing.quantization import E4M3_MAX

from .triton_utils import (INTERPRETED, dependent_launch, device_limits, early_release, find_sequence, next_power_of_2,
                           release_after_wait, release_at_start, round_to_e4m3_grid, search_steps, wait_for_producer)

_LOG2E = 1.4426950408889634


@triton.jit
def _to_pool(x, inv_scale, pool_ptr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr,
             ROUND_IN_FLOAT32: tl.constexpr):
    """x / scale in the pool's dtype; an fp8 pool rounds it to nearest and saturates it at ±FP8_MAX."""
    # Times the float32 reciprocal, as the reference does: a correctly rounded product on every backend.
    x = x.to(tl.float32) * inv_scale
    if QUANTIZE:
        x = tl.clamp(x, -FP8_MAX, FP8_MAX)
        if ROUND_IN_FLOAT32:
            # The interpreter's float32 -> e4m3 cast mis-rounds some values; one already on the grid converts exactly.
            x = round_to_e4m3_grid(x)
    return x.to(pool_ptr.dtype.element_ty)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_inv_scale, v_inv_scale, stride_k_row, stride_v_row,
    stride_kc_block, stride_kc_offset, stride_vc_block, stride_vc_offset, HD: tl.constexpr, BLOCK_HD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_IN_FLOAT32: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):
    release_at_start(PDL, EARLY)
    row = tl.program_id(0).to(tl.int64)
    wait_for_producer(PDL)
    flat_slot = tl.load(slot_mapping_ptr + row)
    if flat_slot >= BLOCK_SIZE:  # negative (padding) and null-block entries are skipped
        block = flat_slot // BLOCK_SIZE
        offset = flat_slot % BLOCK_SIZE
        offs = tl.arange(0, BLOCK_HD)
        mask = offs < HD
        k_val = tl.load(k_ptr + row * stride_k_row + offs, mask=mask)
        v_val = tl.load(v_ptr + row * stride_v_row + offs, mask=mask)
        release_after_wait(PDL, EARLY)
        tl.store(k_cache_ptr + block * stride_kc_block + offset * stride_kc_offset + offs,
                 _to_pool(k_val, k_inv_scale, k_cache_ptr, QUANTIZE, FP8_MAX, ROUND_IN_FLOAT32), mask=mask)
        tl.store(v_cache_ptr + block * stride_vc_block + offset * stride_vc_offset + offs,
                 _to_pool(v_val, v_inv_scale, v_cache_ptr, QUANTIZE, FP8_MAX, ROUND_IN_FLOAT32), mask=mask)


def _require_token_major(cache: torch.Tensor, name: str) -> None:
    hkv, d = cache.shape[2:]
    if cache.stride()[2:] != (d, 1):
        raise ValueError(f"{name} must be contiguous within a token ([num_blocks, block_size, Hkv, D])")


def _check_pools(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Whether the pools are fp8 (quantized); raises ValueError for pools of two dtypes or a scale that is not > 0."""
    _require_token_major(k_cache, "k_cache")
    _require_token_major(v_cache, "v_cache")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"KV scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
    return k_cache.dtype == torch.float8_e4m3fn


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0):
    """k / k_scale and v / v_scale (`[T, Hkv, D]`) stored at flat slots `slot_mapping` (int64); negative and
    null-block entries skipped; an fp8 pool saturates."""
    quantize = _check_pools(k_cache, v_cache, k_scale, v_scale)
    rows = k.shape[0]
    if rows == 0:
        return
    k = k.reshape(rows, -1) if k[0].is_contiguous() else k.contiguous().reshape(rows, -1)
    v = v.reshape(rows, -1) if v[0].is_contiguous() else v.contiguous().reshape(rows, -1)
    hd = k.shape[1]
    pdl = dependent_launch(k.device)
    _write_kv_cache_kernel[(rows,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale, k.stride(0), v.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), HD=hd,
        BLOCK_HD=next_power_of_2(hd), BLOCK_SIZE=k_cache.shape[1], QUANTIZE=quantize,
        FP8_MAX=E4M3_MAX, ROUND_IN_FLOAT32=INTERPRETED, PDL=pdl, EARLY=early_release(k.device),
        num_warps=4, launch_pdl=pdl,
    )


# A mixed step's prefill chunks pass their sequences' rows of the step's tables, which start at any int32 offset:
# those pointers are not specialized on alignment, so no offset compiles the kernel anew.
@triton.jit(do_not_specialize=["num_seqs", "num_search_steps", "num_tokens", "stride_bt_seq"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, o_ptr,
    part_o_ptr, part_m_ptr, part_l_ptr, scale_log2, v_scale, num_seqs, num_search_steps, num_tokens,
    stride_q_row, stride_q_head, stride_kc_block, stride_kc_offset, stride_kc_head, stride_vc_block,
    stride_vc_offset, stride_vc_head, stride_bt_seq, stride_o_row, stride_o_head,
    HQ: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, FLOAT32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    # Launched dependently, the program starts while the kernel before it (the K/V write) finishes and reads nothing
    # before waiting for it: any input may come from it.
    release_at_start(PDL, EARLY)
    wait_for_producer(PDL)
    release_after_wait(PDL, EARLY)
    # Sequence n owns query blocks [cu_q[n] // BLOCK_Q + n, ...): one spare block per sequence keeps this exact.
    seq = find_sequence(cu_seqlens_q_ptr, num_seqs, num_search_steps, q_block, BLOCK_Q, 1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        offs_m = tl.arange(0, BLOCK_M)
        q_index = local_block * BLOCK_Q + offs_m // GROUP_PAD
        head = kv_head * GROUP + offs_m % GROUP_PAD
        row_valid = (q_index < q_len) & (offs_m % GROUP_PAD < GROUP)
        q_pos = seq_len - q_len + q_index
        offs_d = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + q_index).to(tl.int64)
        q_tile = tl.load(q_ptr + q_rows[:, None] * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :],
                         mask=row_valid[:, None], other=0.0)
        if FLOAT32_DOT:
            q_tile = q_tile.to(tl.float32)
        # Keys past the block's last query position are masked for every row: do not visit them.
        kv_len = tl.minimum(seq_len, seq_len - q_len + (local_block + 1) * BLOCK_Q)
        num_tiles = tl.cdiv(kv_len, BLOCK_N)
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_lo = segment * tiles_per_segment
        tile_hi = tl.minimum(num_tiles, tile_lo + tiles_per_segment)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_valid = offs_n < kv_len
            block = tl.load(table + offs_n // PAGE, mask=key_valid, other=0).to(tl.int64)
            in_page = offs_n % PAGE
            k_tile = tl.load(k_cache_ptr + block[None, :] * stride_kc_block + in_page[None, :] * stride_kc_offset
                             + kv_head * stride_kc_head + offs_d[:, None], mask=key_valid[None, :], other=0.0)
            k_tile = k_tile.to(q_tile.dtype)  # an fp8 page widens exactly; k_scale is folded into scale_log2
            if FLOAT32_DOT:
                k_tile = k_tile.to(tl.float32)
            scores = tl.dot(q_tile, k_tile, input_precision=DOT_PRECISION) * scale_log2
            allowed = key_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at zero
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_tile = tl.load(v_cache_ptr + block[:, None] * stride_vc_block + in_page[:, None] * stride_vc_offset
                             + kv_head * stride_vc_head + offs_d[None, :], mask=key_valid[:, None], other=0.0)
            v_tile = v_tile.to(q_tile.dtype)
            if FLOAT32_DOT:
                v_tile = v_tile.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
            m_i = m_new
        acc = acc * v_scale  # the pool holds v / v_scale
        if NUM_SEGMENTS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_ptr + q_rows[:, None] * stride_o_row + head[:, None] * stride_o_head + offs_d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_valid[:, None])
        else:
            part_rows = (segment * num_tokens + q_start + q_index).to(tl.int64) * HQ + head
            # A segment past the keys (decode graphs split for max_model_len, replayed at shorter contexts) leaves
            # its rows' maxima at -inf, so the merge reads no output of it: none is stored.
            if tile_lo < tile_hi:
                tl.store(part_o_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
            tl.store(part_m_ptr + part_rows, m_i, mask=row_valid)
            tl.store(part_l_ptr + part_rows, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_segments_kernel(part_o_ptr, part_m_ptr, part_l_ptr, o_ptr, num_tokens, stride_o_row, stride_o_head,
                           HQ: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                           PDL: tl.constexpr, EARLY: tl.constexpr):
    release_at_start(PDL, EARLY)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    part_rows = (offs_s.to(tl.int64) * num_tokens + row) * HQ + head
    wait_for_producer(PDL)
    release_after_wait(PDL, EARLY)
    m = tl.load(part_m_ptr + part_rows)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(tl.load(part_l_ptr + part_rows) * weight, 0)
    offs_d = tl.arange(0, HEAD_DIM)
    # Segments that saw no key weigh nothing: their outputs are not read (an empty one stores none), so a launch
    # split for a longer context than the step's reads no more here than the segments the keys fill.
    seen = m > float("-inf")
    acc = tl.sum(tl.load(part_o_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=seen[:, None], other=0.0)
                 * weight[:, None], 0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + row * stride_o_row + head * stride_o_head + offs_d, out.to(o_ptr.dtype.element_ty))


# Prefill-shaped calls split a sequence's keys into at most this many segments, each at least this many tiles.
MAX_PREFILL_SEGMENTS = 16
PREFILL_SEGMENT_TILES = 8


def attention_launch_config(num_seqs: int, num_kv_heads: int, group: int, max_seqlen_q: int, max_seqlen_k: int,
                            block_size: int, num_sms: int, head_dim: int = 256, element_bytes: int = 2,
                            shared_memory_bytes: int = 232_448, kv_element_bytes: int | None = None) -> dict:
    """`_launch_config` as a new dict (the caller may update it)."""
    return dict(_launch_config(num_seqs, num_kv_heads, group, max_seqlen_q, max_seqlen_k, block_size, num_sms,
                               head_dim, element_bytes, shared_memory_bytes, kv_element_bytes))


# Remembered: every attention layer of a step asks the same, twice in a mixed step.
@functools.lru_cache(maxsize=4096)
def _launch_config(num_seqs: int, num_kv_heads: int, group: int, max_seqlen_q: int, max_seqlen_k: int,
                   block_size: int, num_sms: int, head_dim: int, element_bytes: int, shared_memory_bytes: int,
                   kv_element_bytes: int | None) -> dict:
    """Tile sizes and split-KV segments for one call (fastest in a sweep on the H200 in bf16): decode-shaped calls use
    16-row tiles and split the keys when the batch alone does not cover the GPU; prefill uses 128-row tiles and
    splits the keys when its query blocks do not cover the SMs.
    Wider elements (float32 caches) shrink the pipeline, then the tiles, until Q (`element_bytes` each) plus the
    staged K/V tiles (`kv_element_bytes`, default the same) fit in `shared_memory_bytes` (the per-block opt-in limit
    of the device)."""
    kv_element_bytes = kv_element_bytes or element_bytes
    group_pad = next_power_of_2(group)
    decode = max_seqlen_q * group_pad <= 16
    block_m = 16 if decode else 128
    block_n = max(block_size, 64)
    num_stages = 3 if decode else 2

    def footprint() -> int:
        return (block_m * element_bytes + num_stages * 2 * block_n * kv_element_bytes) * head_dim

    while footprint() > shared_memory_bytes and num_stages > 1:
        num_stages -= 1
    while footprint() > shared_memory_bytes and block_m > 16:
        block_m //= 2
    while footprint() > shared_memory_bytes and block_n > block_size:
        block_n //= 2
    block_q = max(1, block_m // group_pad)
    segments = 1
    if decode:
        programs = num_seqs * num_kv_heads
        # Up to two programs per SM and 64 segments (fastest at batch 1 with 32k context), each segment at least 4
        # tiles of keys so the merge stays cheap next to the reads.
        while programs * segments < 2 * num_sms and max_seqlen_k >= 2 * segments * 4 * block_n and segments < 64:
            segments *= 2
    else:
        # Prefill tiles are one program per SM: a chunk of few query blocks over a long context (a prompt's later
        # chunks) would leave most SMs idle walking all its keys. Its keys are split into the number of segments
        # (a power of two, each at least PREFILL_SEGMENT_TILES tiles) that cuts the waves of programs per share of
        # the keys by a tenth or more; the query blocks are counted as if every sequence were the longest. On the
        # H200 a 256-token chunk over 6,400 keys took 360 us whole and 112 in four segments, a 640-token one over
        # 16,000 keys 862 and 566 in eight, while fresh prompts, whose blocks already fill the SMs, were slower
        # split (docs/performance.md).
        programs = num_seqs * -(-max_seqlen_q // block_q) * num_kv_heads

        def waves_per_share(count: int) -> float:
            return -(-programs * count // num_sms) / count

        candidate = 2
        while candidate <= MAX_PREFILL_SEGMENTS and max_seqlen_k >= candidate * PREFILL_SEGMENT_TILES * block_n:
            if waves_per_share(candidate) <= 0.9 * waves_per_share(segments):
                segments = candidate
            candidate *= 2
    return {"block_q": block_q, "block_n": block_n, "segments": segments, "num_warps": 4 if decode else 8,
            "num_stages": num_stages}


def launch_for(q: torch.Tensor, k_cache: torch.Tensor, num_seqs: int, max_seqlen_q: int, max_seqlen_k: int) -> dict:
    """`attention_launch_config` of a call with q `[T, Hq, D]` over `k_cache` on their GPU: what `paged_attention`
    launches unless its `config` overrides it."""
    num_sms, shared_memory_bytes = device_limits(q.device)
    num_kv_heads = k_cache.shape[2]
    return attention_launch_config(num_seqs, num_kv_heads, q.shape[1] // num_kv_heads, max_seqlen_q, max_seqlen_k,
                                   k_cache.shape[1], num_sms, q.shape[2], q.element_size(), shared_memory_bytes,
                                   k_cache.element_size())


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k,
                    k_scale: float = 1.0, v_scale: float = 1.0, config: dict | None = None,
                    out: torch.Tensor | None = None):
    """Causal GQA attention of q `[T, Hq, D]` over each sequence's pages; query i of sequence n is at position
    `seq_lens[n] - q_len + i`; the pages hold k / k_scale and v / v_scale. -> o `[T, Hq, D]`, written into `out`
    (rows of any stride, heads and dims contiguous) when given. `config` overrides `attention_launch_config`
    (benchmarks sweep it)."""
    _check_pools(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if head_dim != next_power_of_2(head_dim):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    group = num_q_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    q = q if q.stride(2) == 1 else q.contiguous()
    o = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device) if out is None else out
    if o.shape != q.shape or o.stride()[1:] != (head_dim, 1):
        raise ValueError(f"out must be {tuple(q.shape)} with contiguous heads, got {tuple(o.shape)} {o.stride()}")
    if num_tokens == 0 or num_seqs == 0:
        return o
    launch = launch_for(q, k_cache, num_seqs, max_seqlen_q, max_seqlen_k)
    launch.update(config or {})
    segments = launch["segments"]
    part_o = part_m = part_l = o  # unused when segments == 1
    if segments > 1:
        # One float32 workspace: each segment's partial outputs, then their running maxima and sums.
        rows = segments * num_tokens * num_q_heads
        work = torch.empty(rows * (head_dim + 2), dtype=torch.float32, device=q.device)
        part_o = work[: rows * head_dim].view(segments, num_tokens, num_q_heads, head_dim)
        part_m = work[rows * head_dim : rows * (head_dim + 1)].view(segments, num_tokens, num_q_heads)
        part_l = work[rows * (head_dim + 1) :].view(segments, num_tokens, num_q_heads)
    grid = (num_tokens // launch["block_q"] + num_seqs, num_kv_heads, segments)
    pdl = dependent_launch(q.device)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, o, part_o, part_m, part_l,
        scale * float(k_scale) * _LOG2E, float(v_scale), num_seqs, search_steps(num_seqs), num_tokens, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), o.stride(0), o.stride(1),
        HQ=num_q_heads, GROUP=group, GROUP_PAD=next_power_of_2(group), BLOCK_Q=launch["block_q"],
        HEAD_DIM=head_dim, BLOCK_N=launch["block_n"], PAGE=page, NUM_SEGMENTS=segments,
        FLOAT32_DOT=INTERPRETED, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
        EARLY=early_release(q.device), num_warps=launch["num_warps"], num_stages=launch["num_stages"], launch_pdl=pdl,
    )
    if segments > 1:
        _merge_segments_kernel[(num_tokens, num_q_heads)](
            part_o, part_m, part_l, o, num_tokens, o.stride(0), o.stride(1), HQ=num_q_heads, HEAD_DIM=head_dim,
            NUM_SEGMENTS=segments, PDL=pdl, EARLY=early_release(q.device), num_warps=4,
            launch_pdl=pdl,
        )
    return o
