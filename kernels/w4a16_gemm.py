"""4-bit weight, 16-bit activation GEMM in Triton: y = x W^T with W unpacked from int32 words and dequantized in the
kernel, `(q - z) * s` per group of input channels, for both stored layouts (`hybridkv.sizing.quantization`):

- AWQ: qweight `[K, N/8]` and qzeros `[K/G, N/8]` packed along N in AWQ's column order, scales `[K/G, N]`;
- compressed-tensors: weight_packed `[N, ceil(K/8)]` packed along K, scales `[N, ceil(K/G)]`, zero points
  `[ceil(N/8), ceil(K/G)]` packed along N, or none (symmetric: zero 8).

The weight is read once per column tile in its packed form (a quarter of the bf16 bytes), each int32 word once as part
of a contiguous tile. Two kernels: one token runs on the CUDA cores (`_w4a16_gemv_kernel`), more on the tensor cores
(`_w4a16_gemm_kernel`, the dequantized tile fed to tl.dot). On the H200 both are still bound by the unpacking rather
than the quarter-size reads (docs/performance.md). Reference: `quant_reference.w4a16_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import INTERPRETED, split_k_for


@triton.jit
def _unpack_words(words, ROWS: tl.constexpr, COLUMNS: tl.constexpr, AWQ: tl.constexpr):
    """int32 words `[ROWS, COLUMNS // 8]` -> their eight 4-bit values each, `[ROWS, COLUMNS]` (value j of word w in
    column 8w + j). Sequential order: value j is bits 4j..4j+3; AWQ order: columns 0 2 4 6 1 3 5 7 fill the nibbles."""
    j = tl.arange(0, 8)
    if AWQ:
        shifts = ((j // 2) + (j % 2) * 4) * 4
    else:
        shifts = j * 4
    return tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (ROWS, COLUMNS))


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_x_row, stride_qw_row, stride_s_row,
                       stride_z_row, stride_y_row, GROUP: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ONE_GROUP_PER_BLOCK: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    # Packed words are read as whole tiles along the dimension they pack (contiguous in memory, each word once) and
    # unpacked in registers; gathering a word per weight element would read each eight times, strided.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + rows[:, None] * stride_x_row + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        if AWQ:
            # qweight [K, N/8] packed along N; the dequantized tile is [BLOCK_K, BLOCK_N].
            offs_nw = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
            mask_nw = offs_nw < tl.cdiv(N, 8)
            words = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * stride_qw_row + offs_nw[None, :],
                            mask=mask_k[:, None] & mask_nw[None, :], other=0)
            q = _unpack_words(words, BLOCK_K, BLOCK_N, True)
            if ONE_GROUP_PER_BLOCK:
                # The block lies inside one group: one row of scales and zero points serves all of it.
                group = k_start // GROUP
                zero_words = tl.load(z_ptr + group * stride_z_row + offs_nw, mask=mask_nw, other=0)
                zeros = tl.reshape(_unpack_words(zero_words[None, :], 1, BLOCK_N, True), (BLOCK_N,))[None, :]
                scales = tl.load(s_ptr + group * stride_s_row + cols, mask=mask_n, other=0.0)[None, :]
            else:
                groups = (offs_k // GROUP)[:, None]
                zero_words = tl.load(z_ptr + groups * stride_z_row + offs_nw[None, :],
                                     mask=mask_k[:, None] & mask_nw[None, :], other=0)
                zeros = _unpack_words(zero_words, BLOCK_K, BLOCK_N, True)
                scales = tl.load(s_ptr + groups * stride_s_row + cols[None, :], mask=mask_k[:, None] & mask_n[None, :],
                                 other=0.0)
            w = (q - zeros).to(tl.float32) * scales.to(tl.float32)
            if FLOAT32_DOT:
                acc += tl.dot(a.to(tl.float32), w)
            else:
                acc += tl.dot(a, w.to(a.dtype))
        else:
            # weight_packed [N, ceil(K/8)] packed along K; the dequantized tile is [BLOCK_N, BLOCK_K].
            offs_kw = k_start // 8 + tl.arange(0, BLOCK_K // 8)
            mask_kw = offs_kw < tl.cdiv(K, 8)
            words = tl.load(qw_ptr + cols[:, None] * stride_qw_row + offs_kw[None, :],
                            mask=mask_n[:, None] & mask_kw[None, :], other=0)
            q = _unpack_words(words, BLOCK_N, BLOCK_K, False)
            if ONE_GROUP_PER_BLOCK:
                group = k_start // GROUP
                scale_offsets = (cols * stride_s_row + group)[:, None]
                zero_offsets = ((cols // 8) * stride_z_row + group)[:, None]
                group_mask = mask_n[:, None]
                nibbles = ((offs_n % 8) * 4)[:, None]
            else:
                groups = (offs_k // GROUP)[None, :]
                scale_offsets = cols[:, None] * stride_s_row + groups
                zero_offsets = (cols // 8)[:, None] * stride_z_row + groups
                group_mask = mask_n[:, None] & mask_k[None, :]
                nibbles = ((offs_n % 8) * 4)[:, None]
            scales = tl.load(s_ptr + scale_offsets, mask=group_mask, other=0.0)
            if HAS_ZEROS:
                zeros = (tl.load(z_ptr + zero_offsets, mask=group_mask, other=0) >> nibbles) & 0xF
            else:
                zeros = 8
            w = (q - zeros).to(tl.float32) * scales.to(tl.float32)
            if FLOAT32_DOT:
                acc += tl.dot(a.to(tl.float32), tl.trans(w))
            else:
                acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    tl.store(y_ptr + rows[:, None] * stride_y_row + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


# 2**23 as float32: OR-ing a 4-bit value into its zero mantissa and reading the bits back as a float gives
# 2**23 + value exactly, two integer instructions instead of a slow int -> float conversion.
_FLOAT_BIAS_BITS = tl.constexpr(0x4B000000)
_FLOAT_BIAS = tl.constexpr(8388608.0)


@triton.jit
def _awq_tile(qw_ptr, stride_qw_row, offs_nw, mask_nw, tile, last_tile, K, BLOCK_K: tl.constexpr):
    """Words `[BLOCK_K, BLOCK_N/8]` of K tile `tile` of an AWQ qweight (zeros past `last_tile`)."""
    offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < tl.minimum(K, last_tile * BLOCK_K)
    return tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * stride_qw_row + offs_nw[None, :],
                   mask=mask_k[:, None] & mask_nw[None, :], other=0)


@triton.jit
def _packed_along_k_tile(qw_ptr, stride_qw_row, rows, mask_n, tile, last_tile, K, BLOCK_K: tl.constexpr):
    """Words `[BLOCK_N, BLOCK_K/8]` of K tile `tile` of a compressed-tensors weight_packed (zeros past
    `last_tile`)."""
    offs_kw = tile * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    mask_kw = offs_kw < tl.minimum(tl.cdiv(K, 8), last_tile * (BLOCK_K // 8))
    return tl.load(qw_ptr + rows[:, None] * stride_qw_row + offs_kw[None, :],
                   mask=mask_n[:, None] & mask_kw[None, :], other=0)


@triton.jit
def _awq_plane(words, zero_words, a, s_ptr, cols, mask_cols, acc, COLUMN: tl.constexpr):
    """acc `[BLOCK_K, BLOCK_N/8]` plus the products of output column 8w + COLUMN of an AWQ tile: its nibble of each
    word, less the zero point, times the column's scale and the row's activation."""
    shift = ((COLUMN // 2) + (COLUMN % 2) * 4) * 4
    offsets = ((zero_words >> shift) & 0xF).to(tl.float32) + _FLOAT_BIAS
    scales = tl.load(s_ptr + cols + COLUMN, mask=mask_cols, other=0.0).to(tl.float32)
    biased = (((words >> shift) & 0xF) | _FLOAT_BIAS_BITS).to(tl.float32, bitcast=True)
    return acc + (biased - offsets[None, :]) * (a[:, None] * scales[None, :])


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, N, K, stride_x_row, stride_qw_row, stride_s_row,
                       stride_z_row, stride_y_row, stride_y_split, GROUP: tl.constexpr, AWQ: tl.constexpr,
                       HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr):
    # A few tokens, one per program row of the grid: multiply-adds on the CUDA cores (a tensor-core tile would be
    # nearly all padding) into accumulators shaped like the packed tile, one nibble at a time, summed once at the
    # end: the loop body has no cross-thread reductions and no layout changes. Each K tile lies inside one group
    # (GROUP % BLOCK_K == 0), so it reads one scale and zero point per output channel. With SPLIT_K > 1, program
    # (., ., s) covers the s-th share of the K tiles and stores a float32 partial at y_ptr + s * stride_y_split.
    row = tl.program_id(0).to(tl.int64)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first_tile = tl.program_id(2) * per_split
    last_tile = tl.minimum(first_tile + per_split, k_tiles)
    x_row = x_ptr + row * stride_x_row
    y_row = y_ptr + tl.program_id(2).to(tl.int64) * stride_y_split + row * stride_y_row
    if AWQ:
        # qweight [K, N/8]: a tile is BLOCK_K rows of BLOCK_N/8 words; nibble plane c is output columns 8w + c,
        # each with its own accumulator.
        offs_nw = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        mask_nw = offs_nw < tl.cdiv(N, 8)
        acc0 = tl.zeros([BLOCK_K, BLOCK_N // 8], dtype=tl.float32)
        acc1 = tl.zeros_like(acc0)
        acc2 = tl.zeros_like(acc0)
        acc3 = tl.zeros_like(acc0)
        acc4 = tl.zeros_like(acc0)
        acc5 = tl.zeros_like(acc0)
        acc6 = tl.zeros_like(acc0)
        acc7 = tl.zeros_like(acc0)
        # The next tile's words are loaded before this one's products (the loop's loads are not pipelined for
        # it), so one tile's memory latency hides behind the other's arithmetic.
        next_words = _awq_tile(qw_ptr, stride_qw_row, offs_nw, mask_nw, first_tile, last_tile, K, BLOCK_K)
        for tile in range(first_tile, last_tile):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            words = next_words
            next_words = _awq_tile(qw_ptr, stride_qw_row, offs_nw, mask_nw, tile + 1, last_tile, K, BLOCK_K)
            a = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            group = (tile * BLOCK_K) // GROUP
            zero_words = tl.load(z_ptr + group * stride_z_row + offs_nw, mask=mask_nw, other=0)
            scale_row = s_ptr + group * stride_s_row
            cols = offs_nw * 8
            acc0 = _awq_plane(words, zero_words, a, scale_row, cols, cols < N, acc0, 0)
            acc1 = _awq_plane(words, zero_words, a, scale_row, cols, cols + 1 < N, acc1, 1)
            acc2 = _awq_plane(words, zero_words, a, scale_row, cols, cols + 2 < N, acc2, 2)
            acc3 = _awq_plane(words, zero_words, a, scale_row, cols, cols + 3 < N, acc3, 3)
            acc4 = _awq_plane(words, zero_words, a, scale_row, cols, cols + 4 < N, acc4, 4)
            acc5 = _awq_plane(words, zero_words, a, scale_row, cols, cols + 5 < N, acc5, 5)
            acc6 = _awq_plane(words, zero_words, a, scale_row, cols, cols + 6 < N, acc6, 6)
            acc7 = _awq_plane(words, zero_words, a, scale_row, cols, cols + 7 < N, acc7, 7)
        out_ty = y_ptr.dtype.element_ty
        cols = offs_nw * 8
        tl.store(y_row + cols, tl.sum(acc0, axis=0).to(out_ty), mask=cols < N)
        tl.store(y_row + cols + 1, tl.sum(acc1, axis=0).to(out_ty), mask=cols + 1 < N)
        tl.store(y_row + cols + 2, tl.sum(acc2, axis=0).to(out_ty), mask=cols + 2 < N)
        tl.store(y_row + cols + 3, tl.sum(acc3, axis=0).to(out_ty), mask=cols + 3 < N)
        tl.store(y_row + cols + 4, tl.sum(acc4, axis=0).to(out_ty), mask=cols + 4 < N)
        tl.store(y_row + cols + 5, tl.sum(acc5, axis=0).to(out_ty), mask=cols + 5 < N)
        tl.store(y_row + cols + 6, tl.sum(acc6, axis=0).to(out_ty), mask=cols + 6 < N)
        tl.store(y_row + cols + 7, tl.sum(acc7, axis=0).to(out_ty), mask=cols + 7 < N)
    else:
        # weight_packed [N, ceil(K/8)]: a tile is BLOCK_N rows of BLOCK_K/8 words; nibble j of word w is input
        # channel 8w + j, so every plane adds into one accumulator, scaled once per tile.
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = offs_n.to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        next_words = _packed_along_k_tile(qw_ptr, stride_qw_row, rows, mask_n, first_tile, last_tile, K, BLOCK_K)
        for tile in range(first_tile, last_tile):
            offs_kw = tile * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
            words = next_words
            next_words = _packed_along_k_tile(qw_ptr, stride_qw_row, rows, mask_n, tile + 1, last_tile, K, BLOCK_K)
            group = (tile * BLOCK_K) // GROUP
            scales = tl.load(s_ptr + rows * stride_s_row + group, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zero_words = tl.load(z_ptr + (rows // 8) * stride_z_row + group, mask=mask_n, other=0)
                offsets = ((zero_words >> ((offs_n % 8) * 4)) & 0xF).to(tl.float32) + _FLOAT_BIAS
            else:
                offsets = tl.full([BLOCK_N], 8.0 + _FLOAT_BIAS, tl.float32)
            products = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
            for j in tl.static_range(8):
                channels = offs_kw * 8 + j
                a = tl.load(x_row + channels, mask=channels < K, other=0.0).to(tl.float32)
                biased = (((words >> (4 * j)) & 0xF) | _FLOAT_BIAS_BITS).to(tl.float32, bitcast=True)
                products += (biased - offsets[:, None]) * a[None, :]
            acc += products * scales[:, None]
        tl.store(y_row + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=mask_n)


# Up to this many tokens the weight is multiplied on the CUDA cores, one grid row per token (_w4a16_gemv_kernel).
GEMV_MAX_TOKENS = 1


def w4a16_gemm_config(num_tokens: int, awq_layout: bool = False) -> dict:
    """Launch configuration by token count. One token: the CUDA-core kernel (compressed-tensors: the fastest of the
    sweep on both of Qwen3.5-27B's MLP shapes; AWQ: rows of 128 contiguous bytes of packed words, not swept). Up to
    64 tokens: tensor-core tiles as bench/kernels.py's --sweep found fastest on the H200 (Qwen3.5-27B's gate|up,
    group 128); prefill tiles are square."""
    if num_tokens <= GEMV_MAX_TOKENS:
        if awq_layout:
            return {"block_m": 1, "block_n": 256, "block_k": 32, "num_warps": 4, "num_stages": 3}
        return {"block_m": 1, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3}
    if num_tokens <= 16:
        return {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4}
    if num_tokens <= 64:
        return {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3}
    return {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}


def _gemv(x, qweight, scales, zeros, has_zeros, group_size, awq_layout, out_features, tiles):
    num_tokens, in_features = x.shape
    # The largest power-of-two tile that lies inside one group (groups are multiples of 8).
    block_k = min(tiles["block_k"], group_size & -group_size)
    k_tiles = triton.cdiv(in_features, block_k)
    n_tiles = triton.cdiv(out_features, tiles["block_n"])
    split_k = tiles.get("split_k") or split_k_for(x.device, num_tokens * n_tiles, k_tiles)
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    out = y if split_k == 1 else torch.empty(split_k, num_tokens, out_features, dtype=torch.float32,
                                             device=x.device)
    _w4a16_gemv_kernel[(num_tokens, n_tiles, split_k)](
        x, qweight, scales, zeros, out, out_features, in_features, x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0), out.stride(-2), out.stride(0) if split_k > 1 else 0, GROUP=group_size, AWQ=awq_layout,
        HAS_ZEROS=has_zeros, BLOCK_N=tiles["block_n"], BLOCK_K=block_k, SPLIT_K=split_k,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    if split_k > 1:
        y.copy_(out.sum(0))
    return y


def w4a16_linear(x, qweight, scales, qzeros, group_size: int, awq_layout: bool, config: dict | None = None):
    """x `[M, K]` times the 4-bit weight's transpose -> `[M, N]` in x's dtype; `config` overrides
    `w4a16_gemm_config` (benchmarks sweep it; block_m 1 is the CUDA-core kernel, whose `split_k` shares K among that
    many programs per output tile, chosen to fill the GPU when not given)."""
    num_tokens, in_features = x.shape
    out_features = scales.shape[1] if awq_layout else qweight.shape[0]
    if num_tokens == 0:
        return torch.empty(0, out_features, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    tiles = {**w4a16_gemm_config(num_tokens, awq_layout), **(config or {})}
    zeros = qzeros if qzeros is not None else scales
    if tiles["block_m"] == 1:
        return _gemv(x, qweight, scales, zeros, qzeros is not None, group_size, awq_layout, out_features, tiles)
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if "block_k" not in (config or {}) and group_size < tiles["block_k"] and group_size % 16 == 0:
        tiles["block_k"] = group_size  # blocks inside one group read its scales and zero points once
    grid = (triton.cdiv(num_tokens, tiles["block_m"]), triton.cdiv(out_features, tiles["block_n"]))
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, y, num_tokens, out_features, in_features, x.stride(0), qweight.stride(0),
        scales.stride(0), zeros.stride(0), y.stride(0), GROUP=group_size, AWQ=awq_layout,
        HAS_ZEROS=qzeros is not None, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"],
        ONE_GROUP_PER_BLOCK=group_size % tiles["block_k"] == 0, FLOAT32_DOT=INTERPRETED,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    return y
