"""4-bit weight, 16-bit activation GEMM in Triton: y = x W^T with W unpacked from int32 words and dequantized in the
kernel, `(q - z) * s` per group of input channels, for both stored layouts (`hybridkv.sizing.quantization`):

- AWQ: qweight `[K, N/8]` and qzeros `[K/G, N/8]` packed along N in AWQ's column order, scales `[K/G, N]`;
- compressed-tensors: weight_packed `[N, ceil(K/8)]` packed along K, scales `[N, ceil(K/G)]`, zero points
  `[ceil(N/8), ceil(K/G)]` packed along N, or none (symmetric: zero 8).

The weight is read once per column tile in its packed form (a quarter of the bf16 bytes), each int32 word once as part
of a contiguous tile. Small batches run on the CUDA cores: compressed-tensors up to `GEMV_MAX_TOKENS` tokens in
fp16 pairs (`_packed_along_k_gemv_kernel` at one token, about 2.4-2.6x bf16 on the H200; `_packed_along_k_rows_kernel`
for two to four, the words read once for all of them), AWQ at one token (`_awq_gemv_kernel`, float32); these three
launch dependently on Hopper (`triton_utils.dependent_launch`: the first weight tile is loaded before the wait for
the kernel that writes the input). More tokens
run on the tensor cores (`_w4a16_gemm_kernel`: the integer weights q - z fed to tl.dot and the result scaled per
group, K split among programs at decode sizes; at 5-64 tokens still slower than the bf16 product, bound by the
unpacking rather than the quarter-size reads). From
`DEQUANTIZE_MIN_TOKENS` tokens the weight is dequantized once (`dequantize`) and multiplied by the dense GEMM
(docs/performance.md). Reference: `quant_reference.w4a16_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.sizing.quantization import W4A16_DEQUANTIZE_MIN_TOKENS

from .triton_utils import (INTERPRETED, cdiv, dependent_launch, finish_split_k, next_power_of_2, release_dependents,
                           split_k_for, split_k_workspace, wait_for_producer)


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


@triton.jit
def _integer_weights(q, zeros, like, FLOAT32_DOT: tl.constexpr):
    """4-bit values less their zero points (both int32 in 0..15) as the dot's exact operand in the dtype of `like`
    (the activations): OR-ing a value into bf16 128.0 (0x4300) or fp16 1024.0 (0x6400), whose last mantissa bit is
    worth one, reads it as 128 + value (1024 + value), and the difference of two such is exact; no int -> float
    conversions. Under the interpreter, and for float32 activations, float32."""
    if FLOAT32_DOT or like.dtype == tl.float32:
        return (q - zeros).to(tl.float32)
    if like.dtype == tl.float16:
        biased = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        biased_zeros = (zeros | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        biased = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        biased_zeros = (zeros | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return biased - biased_zeros


@triton.jit
def _dequantized(q, s_ptr, z_ptr, offs_n, offs_k, N, K, stride_s_row, stride_z_row, GROUP: tl.constexpr,
                 AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Unpacked 4-bit values `q` of output channels `offs_n` by input channels `offs_k` (AWQ: `[K, N]` as stored;
    compressed-tensors: `[N, K]`) as float32 `(q - z) * s`, each channel's group read for it."""
    mask_n = offs_n < N
    mask_k = offs_k < K
    cols = offs_n.to(tl.int64)
    if AWQ:
        groups = (offs_k // GROUP)[:, None]
        mask = mask_k[:, None] & mask_n[None, :]
        zeros = (tl.load(z_ptr + groups * stride_z_row + (cols // 8)[None, :], mask=mask, other=0)
                 >> ((((offs_n % 8) // 2) + ((offs_n % 8) % 2) * 4) * 4)[None, :]) & 0xF
        scales = tl.load(s_ptr + groups * stride_s_row + cols[None, :], mask=mask, other=0.0)
    else:
        groups = (offs_k // GROUP)[None, :]
        mask = mask_n[:, None] & mask_k[None, :]
        scales = tl.load(s_ptr + cols[:, None] * stride_s_row + groups, mask=mask, other=0.0)
        if HAS_ZEROS:
            zeros = (tl.load(z_ptr + (cols // 8)[:, None] * stride_z_row + groups, mask=mask, other=0)
                     >> ((offs_n % 8) * 4)[:, None]) & 0xF
        else:
            zeros = 8
    return (q - zeros).to(tl.float32) * scales.to(tl.float32)


@triton.jit
def _group_scales_and_zeros(s_ptr, z_ptr, group, offs_n, N, stride_s_row, stride_z_row, AWQ: tl.constexpr,
                            HAS_ZEROS: tl.constexpr):
    """Float32 scales and int32 zero points `[BLOCK_N]` of output channels `offs_n` in one group: a tile inside one
    group reads them once per output channel rather than once per weight."""
    mask_n = offs_n < N
    cols = offs_n.to(tl.int64)
    if AWQ:
        scales = tl.load(s_ptr + group * stride_s_row + cols, mask=mask_n, other=0.0).to(tl.float32)
        zeros = (tl.load(z_ptr + group * stride_z_row + cols // 8, mask=mask_n, other=0)
                 >> ((((offs_n % 8) // 2) + ((offs_n % 8) % 2) * 4) * 4)) & 0xF
    else:
        scales = tl.load(s_ptr + cols * stride_s_row + group, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zeros = (tl.load(z_ptr + (cols // 8) * stride_z_row + group, mask=mask_n, other=0)
                     >> ((offs_n % 8) * 4)) & 0xF
        else:
            zeros = tl.full([offs_n.shape[0]], 8, tl.int32)
    return scales, zeros


@triton.jit
def _dequantize_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qw_row, stride_s_row, stride_z_row, stride_w_row,
                       GROUP: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    # One tile of the dequantized weight, in the stored orientation (AWQ `[K, N]`, compressed-tensors `[N, K]`),
    # rounded once to w's dtype. A tile inside one group (GROUP a multiple of BLOCK_K) reads its scales and zero
    # points once per output channel.
    ONE_GROUP: tl.constexpr = GROUP % BLOCK_K == 0
    group = (tl.program_id(1) * BLOCK_K) // GROUP
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    if AWQ:
        offs_nw = tl.program_id(0) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        words = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * stride_qw_row + offs_nw[None, :],
                        mask=mask_k[:, None] & (offs_nw < tl.cdiv(N, 8))[None, :], other=0)
        q = _unpack_words(words, BLOCK_K, BLOCK_N, True)
        if ONE_GROUP:
            scales, zeros = _group_scales_and_zeros(s_ptr, z_ptr, group, offs_n, N, stride_s_row, stride_z_row, True,
                                                    HAS_ZEROS)
            w = (q - zeros[None, :]).to(tl.float32) * scales[None, :]
        else:
            w = _dequantized(q, s_ptr, z_ptr, offs_n, offs_k, N, K, stride_s_row, stride_z_row, GROUP, True,
                             HAS_ZEROS)
        tl.store(w_ptr + offs_k[:, None].to(tl.int64) * stride_w_row + offs_n[None, :],
                 w.to(w_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])
    else:
        offs_kw = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words = tl.load(qw_ptr + offs_n[:, None].to(tl.int64) * stride_qw_row + offs_kw[None, :],
                        mask=mask_n[:, None] & (offs_kw < tl.cdiv(K, 8))[None, :], other=0)
        q = _unpack_words(words, BLOCK_N, BLOCK_K, False)
        if ONE_GROUP:
            scales, zeros = _group_scales_and_zeros(s_ptr, z_ptr, group, offs_n, N, stride_s_row, stride_z_row, False,
                                                    HAS_ZEROS)
            w = (q - zeros[:, None]).to(tl.float32) * scales[:, None]
        else:
            w = _dequantized(q, s_ptr, z_ptr, offs_n, offs_k, N, K, stride_s_row, stride_z_row, GROUP, False,
                             HAS_ZEROS)
        tl.store(w_ptr + offs_n[:, None].to(tl.int64) * stride_w_row + offs_k[None, :],
                 w.to(w_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_k[None, :])


@triton.jit(do_not_specialize=["M", "stride_share"])
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, shares_ptr, counters_ptr, M, N, K, stride_x_row,
                       stride_qw_row, stride_s_row, stride_z_row, stride_y_row, stride_share, GROUP: tl.constexpr,
                       AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, ONE_GROUP_PER_BLOCK: tl.constexpr, FLOAT32_DOT: tl.constexpr,
                       SPLIT_K: tl.constexpr):
    # Packed words are read as whole tiles along the dimension they pack (contiguous in memory, each word once) and
    # unpacked in registers; gathering a word per weight element would read each eight times, strided. When a block
    # lies inside one group, the dot takes the integer weights q - z (exact in bf16) and its result is scaled per
    # output column once: one multiply per output element and block instead of one per weight. With SPLIT_K > 1,
    # program (., ., s) covers the s-th share of the K blocks and the last share in sums them (finish_split_k).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    k_first = tl.program_id(2) * per_split * BLOCK_K
    k_last = tl.minimum(k_first + per_split * BLOCK_K, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(k_first, k_last, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + rows[:, None] * stride_x_row + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        if FLOAT32_DOT:
            a = a.to(tl.float32)
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
                scales = tl.load(s_ptr + group * stride_s_row + cols, mask=mask_n, other=0.0).to(tl.float32)
                acc += tl.dot(a, _integer_weights(q, zeros, a, FLOAT32_DOT)) * scales[None, :]
            else:
                w = _dequantized(q, s_ptr, z_ptr, offs_n, offs_k, N, K, stride_s_row, stride_z_row, GROUP, True,
                                 HAS_ZEROS)
                acc += tl.dot(a, w.to(a.dtype))
        else:
            # weight_packed [N, ceil(K/8)] packed along K; the dequantized tile is [BLOCK_N, BLOCK_K].
            offs_kw = k_start // 8 + tl.arange(0, BLOCK_K // 8)
            mask_kw = offs_kw < tl.cdiv(K, 8)
            words = tl.load(qw_ptr + cols[:, None] * stride_qw_row + offs_kw[None, :],
                            mask=mask_n[:, None] & mask_kw[None, :], other=0)
            q = _unpack_words(words, BLOCK_N, BLOCK_K, False)
            nibbles = ((offs_n % 8) * 4)[:, None]
            if ONE_GROUP_PER_BLOCK:
                group = k_start // GROUP
                scales = tl.load(s_ptr + cols * stride_s_row + group, mask=mask_n, other=0.0).to(tl.float32)
                if HAS_ZEROS:
                    zeros = (tl.load(z_ptr + ((cols // 8) * stride_z_row + group)[:, None], mask=mask_n[:, None],
                                     other=0) >> nibbles) & 0xF
                else:
                    zeros = tl.full([BLOCK_N, 1], 8, tl.int32)
                acc += tl.dot(a, tl.trans(_integer_weights(q, zeros, a, FLOAT32_DOT))) * scales[None, :]
            else:
                w = _dequantized(q, s_ptr, z_ptr, offs_n, offs_k, N, K, stride_s_row, stride_z_row, GROUP, False,
                                 HAS_ZEROS)
                acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    y_ptrs = y_ptr + rows[:, None] * stride_y_row + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        finish_split_k(acc, y_ptrs, shares_ptr + rows[:, None] * N + offs_n[None, :], stride_share,
                       counters_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.program_id(2),
                       mask, SPLIT_K)


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
def _awq_plane(words, zero_words, a, s_ptr, cols, mask_cols, acc, COLUMN: tl.constexpr):
    """acc `[BLOCK_K, BLOCK_N/8]` plus the products of output column 8w + COLUMN of an AWQ tile: its nibble of each
    word, less the zero point, times the column's scale and the row's activation."""
    shift = ((COLUMN // 2) + (COLUMN % 2) * 4) * 4
    offsets = ((zero_words >> shift) & 0xF).to(tl.float32) + _FLOAT_BIAS
    scales = tl.load(s_ptr + cols + COLUMN, mask=mask_cols, other=0.0).to(tl.float32)
    biased = (((words >> shift) & 0xF) | _FLOAT_BIAS_BITS).to(tl.float32, bitcast=True)
    return acc + (biased - offsets[None, :]) * (a[:, None] * scales[None, :])


@triton.jit
def _awq_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, N, K, stride_x_row, stride_qw_row, stride_s_row,
                     stride_z_row, stride_y_row, stride_y_split, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
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
    wait_for_producer(PDL)  # launched dependently, the first words' load overlaps the kernel that writes x
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
    release_dependents(PDL)
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


# One packed-along-K word against its eight activations, in fp16 pairs. OR-ing fp16 1024 (0x6400, whose last mantissa
# bit is worth one) into the halves of (word & 0x000F000F) reads nibbles 0 and 4 as 1024 + q; into (word & 0x00F000F0)
# it reads nibbles 1 and 5 as 1024 + 16 q, which times 1/16 less 64 + z is q - z again; the word shifted right by 8
# gives nibbles 2, 6 and 3, 7 the same way. Each pair's q - z (exact) times the activations of the same two channels
# (packed alike) is summed in the pair, the pair's halves added, and the sum converted to float32: one shift and
# four logic instructions for eight weights. $1: the word, $2-$5: activation pairs p = 0..3 (channels p, p + 4),
# $6: 1024 + z in both halves, $7: -(64 + z) in both halves.
_WORD_DOT_ASM = tl.constexpr("""
{
.reg .b32 t, h, a, sixteenth;
.reg .b16 lo, hi, sum;
mov.b32 sixteenth, 0x2C002C00;
lop3.b32 h, $1, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 h, h, $6;
mul.rn.f16x2 a, h, $2;
lop3.b32 h, $1, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 h, h, sixteenth, $7;
fma.rn.f16x2 a, h, $3, a;
shr.u32 t, $1, 8;
lop3.b32 h, t, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 h, h, $6;
fma.rn.f16x2 a, h, $4, a;
lop3.b32 h, t, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 h, h, sixteenth, $7;
fma.rn.f16x2 a, h, $5, a;
mov.b32 {lo, hi}, a;
add.rn.f16 sum, lo, hi;
cvt.f32.f16 $0, sum;
}
""")

# The activations are scaled so that their largest magnitude is this before the fp16 products: a word's eight
# products of at most 15 times it sum to at most 30,720, inside fp16's range, and fp16 keeps 11 significant bits at
# every size.
_HALF_ACTIVATION_PEAK = tl.constexpr(256.0)
# Channels per load of the activations' peak pass (PEAK_CHUNKS of them cover a program's share of K).
_PEAK_CHUNK = tl.constexpr(1024)


@triton.jit
def _share_tiles(K, GROUP: tl.constexpr, GROUPS_PER_TILE: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [first, last) of this program's share (program_id(2) of SPLIT_K), as the host sizes the
    activations' peak pass for them (`_gemv`'s PEAK_CHUNKS)."""
    tiles = tl.cdiv(tl.cdiv(K, GROUP), GROUPS_PER_TILE)
    per_split = tl.cdiv(tiles, SPLIT_K)
    first_tile = tl.program_id(2) * per_split
    return first_tile, tl.minimum(first_tile + per_split, tiles)


@triton.jit
def _share_scale(x_rows, live_rows, first_tile, last_tile, K, GROUP: tl.constexpr, GROUPS_PER_TILE: tl.constexpr,
                 PEAK_CHUNKS: tl.constexpr):
    """Per token `[R]` (pointers `x_rows`), the power of two (scale, 1 / scale) that brings the peak magnitude of
    its activations in tiles first_tile..last_tile to at most _HALF_ACTIVATION_PEAK: a power of two, so scaling and
    scaling back are exact. PEAK_CHUNKS loads of _PEAK_CHUNK channels cover a share; they are independent and go
    out together."""
    first = first_tile * (GROUPS_PER_TILE * GROUP)
    end = tl.minimum(last_tile * (GROUPS_PER_TILE * GROUP), K)
    peak = tl.zeros([x_rows.shape[0], _PEAK_CHUNK], dtype=tl.float32)
    for chunk in tl.static_range(PEAK_CHUNKS):
        offs = first + chunk * _PEAK_CHUNK + tl.arange(0, _PEAK_CHUNK)
        peak = tl.maximum(peak, tl.abs(tl.load(x_rows[:, None] + offs[None, :],
                                               mask=live_rows[:, None] & (offs < end)[None, :],
                                               other=0.0).to(tl.float32)))
    x_scale = tl.exp2(tl.ceil(tl.log2(tl.maximum(tl.max(peak, 1), 1e-30) / _HALF_ACTIVATION_PEAK)))
    return x_scale, 1.0 / x_scale


@triton.jit
def _half_pair(low, high, USE_ASM: tl.constexpr):
    """Two float32 tensors rounded to fp16 and packed into int32 words (low in bits 0-15): one conversion
    instruction per pair on the GPU."""
    if USE_ASM:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [low, high], dtype=tl.int32,
                                         is_pure=True, pack=1)
    low_bits = low.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    high_bits = high.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return (high_bits << 16) | low_bits


@triton.jit
def _packed_along_k_weights(qw_ptr, s_ptr, z_ptr, rows, mask_n, tile, last_tile, K, stride_qw_row, stride_s_row,
                            stride_z_row, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                            GROUPS_PER_TILE: tl.constexpr, WORDS_PAD: tl.constexpr, WHOLE_GROUPS: tl.constexpr):
    """Tile `tile`'s packed words `[BLOCK_N, G, W]` and its float32 group scales and zero points `[BLOCK_N, G]`;
    all zeros past `last_tile`, so a prefetch past the end reads nothing. WHOLE_GROUPS: K is a whole number of
    groups of a power-of-two number of words, so the masks are per group and the loads vectorize."""
    WORDS: tl.constexpr = GROUP // 8
    offs_g = tl.arange(0, GROUPS_PER_TILE)
    offs_w = tl.arange(0, WORDS_PAD)
    words_k = tile * (GROUPS_PER_TILE * WORDS) + offs_g[:, None] * WORDS + offs_w[None, :]
    groups = tile * GROUPS_PER_TILE + offs_g
    live_groups = groups < tl.minimum(tl.cdiv(K, GROUP), last_tile * GROUPS_PER_TILE)
    if WHOLE_GROUPS:
        in_k = live_groups[:, None] & (offs_w >= 0)[None, :]
    else:
        in_k = (offs_w < WORDS)[None, :] & (words_k < tl.minimum(tl.cdiv(K, 8), last_tile * GROUPS_PER_TILE * WORDS))
    words = tl.load(qw_ptr + rows[:, None, None] * stride_qw_row + words_k[None, :, :],
                    mask=mask_n[:, None, None] & in_k[None, :, :], other=0)
    group_mask = mask_n[:, None] & live_groups[None, :]
    scales = tl.load(s_ptr + rows[:, None] * stride_s_row + groups[None, :], mask=group_mask,
                     other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zeros = (tl.load(z_ptr + (rows // 8)[:, None] * stride_z_row + groups[None, :], mask=group_mask,
                         other=0) >> ((rows % 8) * 4).to(tl.int32)[:, None]) & 0xF
    else:
        zeros = tl.full([rows.shape[0], GROUPS_PER_TILE], 8, tl.int32)
    return words, scales, zeros


@triton.jit
def _tile_channels(tile, last_tile, K, GROUP: tl.constexpr, GROUPS_PER_TILE: tl.constexpr, WORDS_PAD: tl.constexpr,
                   WHOLE_GROUPS: tl.constexpr):
    """Input channels `[G, W, 4]` of tile `tile`'s words (8 * word + p, whose pair is the channel 4 later), and the
    masks of the two (nothing past `last_tile`)."""
    WORDS: tl.constexpr = GROUP // 8
    offs_g = tl.arange(0, GROUPS_PER_TILE)
    offs_w = tl.arange(0, WORDS_PAD)
    offs_p = tl.arange(0, 4)
    words_k = tile * (GROUPS_PER_TILE * WORDS) + offs_g[:, None] * WORDS + offs_w[None, :]
    groups = tile * GROUPS_PER_TILE + offs_g
    live_groups = groups < tl.minimum(tl.cdiv(K, GROUP), last_tile * GROUPS_PER_TILE)
    channels = words_k[:, :, None] * 8 + offs_p[None, None, :]
    if WHOLE_GROUPS:
        x_mask = live_groups[:, None, None] & (channels >= 0)
        high_mask = x_mask
    else:
        in_k = (offs_w < WORDS)[None, :] & (words_k < tl.minimum(tl.cdiv(K, 8), last_tile * GROUPS_PER_TILE * WORDS))
        x_mask = in_k[:, :, None] & (channels < K)
        high_mask = in_k[:, :, None] & (channels + 4 < K)
    return channels, x_mask, high_mask


@triton.jit
def _packed_along_k_activations(x_row, tile, last_tile, K, x_inverse_scale, GROUP: tl.constexpr,
                                GROUPS_PER_TILE: tl.constexpr, WORDS_PAD: tl.constexpr, WHOLE_GROUPS: tl.constexpr):
    """Tile `tile`'s activations of one token, scaled, as `[G, W, 4]` twice: channels 8 * word + p and
    8 * word + 4 + p, the pairs one word's nibbles make (_WORD_DOT_ASM); zeros past `last_tile`."""
    channels, x_mask, high_mask = _tile_channels(tile, last_tile, K, GROUP, GROUPS_PER_TILE, WORDS_PAD,
                                                 WHOLE_GROUPS)
    x_low = tl.load(x_row + channels, mask=x_mask, other=0.0).to(tl.float32) * x_inverse_scale
    x_high = tl.load(x_row + channels + 4, mask=high_mask, other=0.0).to(tl.float32) * x_inverse_scale
    return x_low, x_high


@triton.jit
def _token_rows_activations(x_rows, live_rows, tile, last_tile, K, x_inverse_scale, GROUP: tl.constexpr,
                            GROUPS_PER_TILE: tl.constexpr, WORDS_PAD: tl.constexpr, WHOLE_GROUPS: tl.constexpr):
    """The same for the tokens at `x_rows` `[R]`, each scaled by its `x_inverse_scale` `[R]`, as `[R, G, W, 4]`
    twice; rows past the batch (`live_rows` false) read as zeros."""
    channels, x_mask, high_mask = _tile_channels(tile, last_tile, K, GROUP, GROUPS_PER_TILE, WORDS_PAD,
                                                 WHOLE_GROUPS)
    pointers = x_rows[:, None, None, None] + channels[None, :, :, :]
    live = live_rows[:, None, None, None]
    inverse_scale = x_inverse_scale[:, None, None, None]
    x_low = tl.load(pointers, mask=live & x_mask[None, :, :, :], other=0.0).to(tl.float32) * inverse_scale
    x_high = tl.load(pointers + 4, mask=live & high_mask[None, :, :, :], other=0.0).to(tl.float32) * inverse_scale
    return x_low, x_high


@triton.jit
def _word_dots(words, pair0, pair1, pair2, pair3, zeros):
    """_WORD_DOT_ASM on operands of one broadcast shape: words, the activation pairs p = 0..3 (fp16 pairs in int32
    words), the words' zero points."""
    biased_zeros = zeros | 0x6400  # fp16 1024 + z
    negative_zeros = (zeros << 4) | 0xD400  # fp16 -(64 + z)
    return tl.inline_asm_elementwise(
        _WORD_DOT_ASM, "=r,r,r,r,r,r,r,r",
        [words, pair0, pair1, pair2, pair3, biased_zeros | (biased_zeros << 16),
         negative_zeros | (negative_zeros << 16)], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _word_products(words, scales, zeros, x_low, x_high, GROUPS_PER_TILE: tl.constexpr, WORDS_PAD: tl.constexpr,
                   USE_ASM: tl.constexpr):
    """One tile's words `[BLOCK_N, G, W]` against one token's activations (_packed_along_k_activations), each
    word's sum times its group's scale."""
    if USE_ASM:
        # Pairs (p, p + 4) [G, W, 4], the four p apart (p = 2b + c).
        even, odd = tl.split(tl.reshape(_half_pair(x_low, x_high, USE_ASM), (GROUPS_PER_TILE, WORDS_PAD, 2, 2)))
        pair0, pair2 = tl.split(even)
        pair1, pair3 = tl.split(odd)
        partial = _word_dots(words, pair0[None, :, :], pair1[None, :, :], pair2[None, :, :], pair3[None, :, :],
                             zeros[:, :, None])
    else:
        # The same products in float32 (the interpreter runs no PTX): fp16-rounded activations times q - z.
        offs_p = tl.arange(0, 4)
        low = (words[:, :, :, None] >> (offs_p * 4)[None, None, None, :]) & 0xF
        high = (words[:, :, :, None] >> (offs_p * 4 + 16)[None, None, None, :]) & 0xF
        zeros = zeros[:, :, None, None]
        partial = tl.sum((low - zeros).to(tl.float32) * x_low.to(tl.float16).to(tl.float32)[None, :, :, :]
                         + (high - zeros).to(tl.float32) * x_high.to(tl.float16).to(tl.float32)[None, :, :, :],
                         axis=3)
    return partial * scales[:, :, None]


@triton.jit
def _rows_word_products(words, scales, zeros, x_low, x_high, ROWS: tl.constexpr, GROUPS_PER_TILE: tl.constexpr,
                        WORDS_PAD: tl.constexpr, USE_ASM: tl.constexpr):
    """The same against ROWS tokens' activations (_token_rows_activations): `[ROWS, BLOCK_N, G, W]`. Each token's
    products unpack the words again, in registers: the words are read once for all the tokens."""
    if USE_ASM:
        even, odd = tl.split(tl.reshape(_half_pair(x_low, x_high, USE_ASM),
                                        (ROWS, GROUPS_PER_TILE, WORDS_PAD, 2, 2)))
        pair0, pair2 = tl.split(even)
        pair1, pair3 = tl.split(odd)
        partial = _word_dots(words[None, :, :, :], pair0[:, None, :, :], pair1[:, None, :, :],
                             pair2[:, None, :, :], pair3[:, None, :, :], zeros[None, :, :, None])
    else:
        offs_p = tl.arange(0, 4)
        low = (words[:, :, :, None] >> (offs_p * 4)[None, None, None, :]) & 0xF
        high = (words[:, :, :, None] >> (offs_p * 4 + 16)[None, None, None, :]) & 0xF
        zeros = zeros[:, :, None, None]
        partial = tl.sum((low - zeros).to(tl.float32)[None, :, :, :, :]
                         * x_low.to(tl.float16).to(tl.float32)[:, None, :, :, :]
                         + (high - zeros).to(tl.float32)[None, :, :, :, :]
                         * x_high.to(tl.float16).to(tl.float32)[:, None, :, :, :], axis=4)
    return partial * scales[None, :, :, None]


@triton.jit
def _packed_along_k_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, shares_ptr, counters_ptr, N, K, stride_x_row,
                                stride_qw_row, stride_s_row, stride_z_row, stride_y_row, stride_share,
                                GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                                GROUPS_PER_TILE: tl.constexpr, WORDS_PAD: tl.constexpr, WHOLE_GROUPS: tl.constexpr,
                                SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr, PEAK_CHUNKS: tl.constexpr,
                                PDL: tl.constexpr):
    # compressed-tensors weight_packed [N, ceil(K/8)], one token per grid row: a tile is BLOCK_N output channels by
    # GROUPS_PER_TILE whole groups of GROUP / 8 words (WORDS_PAD: that rounded up to a power of two). Each word is
    # multiplied against its eight activations in fp16 pairs (_WORD_DOT_ASM) and its float32 sum, times the group's
    # scale, added to an accumulator shaped like the tile; the row sums come once, at the end. The activations are
    # scaled by their peak magnitude over the program's share of K first (fp16's range) and the result scaled
    # back: each share's partial sum is exact in its own power-of-two scale, so a share reads only its own
    # activations. The operands are loaded one tile ahead of their products (Triton does not pipeline a loop
    # without a dot; tl.range's pipeline with 2-4 tiles in flight, and two tiles ahead in registers, were slower
    # on the H200). With SPLIT_K > 1, program (., ., s) covers the s-th share of the tiles and the last share in
    # sums them (finish_split_k).
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    first_tile, last_tile = _share_tiles(K, GROUP, GROUPS_PER_TILE, SPLIT_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    # The first tile's weights are asked for before the activations' peak is found, so their memory latency
    # overlaps that pass (every program starts with it); its PEAK_CHUNKS loads are independent and go out together.
    # Launched dependently, that load also overlaps the kernel that writes x.
    weights_ahead = _packed_along_k_weights(qw_ptr, s_ptr, z_ptr, rows, mask_n, first_tile, last_tile, K,
                                            stride_qw_row, stride_s_row, stride_z_row, GROUP, HAS_ZEROS,
                                            GROUPS_PER_TILE, WORDS_PAD, WHOLE_GROUPS)
    wait_for_producer(PDL)
    # One row: the [1] results of the rows' helper as scalars.
    x_scale, x_inverse_scale = _share_scale(x_row + tl.zeros([1], dtype=tl.int32), tl.full([1], True, tl.int1),
                                            first_tile, last_tile, K, GROUP, GROUPS_PER_TILE, PEAK_CHUNKS)
    x_scale = tl.max(x_scale, 0)
    x_inverse_scale = tl.max(x_inverse_scale, 0)
    acc = tl.zeros([BLOCK_N, GROUPS_PER_TILE, WORDS_PAD], dtype=tl.float32)
    activations_ahead = _packed_along_k_activations(x_row, first_tile, last_tile, K, x_inverse_scale, GROUP,
                                                    GROUPS_PER_TILE, WORDS_PAD, WHOLE_GROUPS)
    for tile in range(first_tile, last_tile):
        words, scales, zeros = weights_ahead
        x_low, x_high = activations_ahead
        weights_ahead = _packed_along_k_weights(qw_ptr, s_ptr, z_ptr, rows, mask_n, tile + 1, last_tile, K,
                                                stride_qw_row, stride_s_row, stride_z_row, GROUP, HAS_ZEROS,
                                                GROUPS_PER_TILE, WORDS_PAD, WHOLE_GROUPS)
        activations_ahead = _packed_along_k_activations(x_row, tile + 1, last_tile, K, x_inverse_scale, GROUP,
                                                        GROUPS_PER_TILE, WORDS_PAD, WHOLE_GROUPS)
        acc += _word_products(words, scales, zeros, x_low, x_high, GROUPS_PER_TILE, WORDS_PAD, USE_ASM)
    release_dependents(PDL)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * x_scale
    y_ptrs = y_ptr + row * stride_y_row + offs_n
    if SPLIT_K == 1:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        finish_split_k(y, y_ptrs, shares_ptr + row * N + offs_n, stride_share,
                       counters_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.program_id(2), mask_n, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def _packed_along_k_rows_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, shares_ptr, counters_ptr, M, N, K,
                                stride_x_row, stride_qw_row, stride_s_row, stride_z_row, stride_y_row, stride_share,
                                GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, ROWS: tl.constexpr,
                                BLOCK_N: tl.constexpr, GROUPS_PER_TILE: tl.constexpr, WORDS_PAD: tl.constexpr,
                                WHOLE_GROUPS: tl.constexpr, SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr,
                                PEAK_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    # The one-token kernel above for ROWS tokens per grid row (a few tokens: a small decode batch): each tile's
    # words are read once and multiplied against every token's activations, each token scaled by its own peak,
    # with an accumulator per token. (At one token the kernel above is faster than this one with ROWS 1.)
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live_rows = tokens < M
    x_rows = x_ptr + tokens.to(tl.int64) * stride_x_row
    first_tile, last_tile = _share_tiles(K, GROUP, GROUPS_PER_TILE, SPLIT_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    weights_ahead = _packed_along_k_weights(qw_ptr, s_ptr, z_ptr, rows, mask_n, first_tile, last_tile, K,
                                            stride_qw_row, stride_s_row, stride_z_row, GROUP, HAS_ZEROS,
                                            GROUPS_PER_TILE, WORDS_PAD, WHOLE_GROUPS)
    wait_for_producer(PDL)
    x_scale, x_inverse_scale = _share_scale(x_rows, live_rows, first_tile, last_tile, K, GROUP, GROUPS_PER_TILE,
                                            PEAK_CHUNKS)
    acc = tl.zeros([ROWS, BLOCK_N, GROUPS_PER_TILE, WORDS_PAD], dtype=tl.float32)
    activations_ahead = _token_rows_activations(x_rows, live_rows, first_tile, last_tile, K, x_inverse_scale, GROUP,
                                                GROUPS_PER_TILE, WORDS_PAD, WHOLE_GROUPS)
    for tile in range(first_tile, last_tile):
        words, scales, zeros = weights_ahead
        x_low, x_high = activations_ahead
        weights_ahead = _packed_along_k_weights(qw_ptr, s_ptr, z_ptr, rows, mask_n, tile + 1, last_tile, K,
                                                stride_qw_row, stride_s_row, stride_z_row, GROUP, HAS_ZEROS,
                                                GROUPS_PER_TILE, WORDS_PAD, WHOLE_GROUPS)
        activations_ahead = _token_rows_activations(x_rows, live_rows, tile + 1, last_tile, K, x_inverse_scale,
                                                    GROUP, GROUPS_PER_TILE, WORDS_PAD, WHOLE_GROUPS)
        acc += _rows_word_products(words, scales, zeros, x_low, x_high, ROWS, GROUPS_PER_TILE, WORDS_PAD, USE_ASM)
    release_dependents(PDL)
    y = tl.sum(tl.sum(acc, axis=3), axis=2) * x_scale[:, None]
    offsets = tokens.to(tl.int64)[:, None] * stride_y_row + offs_n[None, :]
    mask = live_rows[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        finish_split_k(y, y_ptr + offsets, shares_ptr + tokens.to(tl.int64)[:, None] * N + offs_n[None, :],
                       stride_share, counters_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                       tl.program_id(2), mask, SPLIT_K)


# Up to this many tokens the weight is multiplied on the CUDA cores: AWQ at one token (_awq_gemv_kernel),
# compressed-tensors up to this many tokens per grid row, the words read once for all of them
# (_packed_along_k_gemv_kernel, _packed_along_k_rows_kernel). On the H200, two and four tokens took 0.3-0.7x the
# tensor-core tiles' time on Qwen3.5-9B's and 27B's projections; eight rows per program were slower than the tiles
# on the narrow ones (docs/performance.md).
GEMV_MAX_TOKENS = 4
# A configuration's block_m below this picks the CUDA-core kernel (block_m tokens per program, a power of two);
# from it, the tensor-core tiles.
TENSOR_CORE_MIN_ROWS = 16


# Outputs wider than this count as wide in `w4a16_gemm_config`: their 128-column tiles already give the GPU a few
# hundred programs with K split in two to four, while narrower outputs (4,096-5,120 columns: the 9B/27B down and
# output projections, 32-40 column tiles) split it in eight.
WIDE_OUTPUT = 8192

# From this many tokens a product dequantizes the weight once and hands it to the dense GEMM (cuBLAS on the GPU):
# the tile kernel unpacks the whole weight again for every 64 rows, the dense GEMM's time grows with the rows alone
# (on the H200 the tiles took 1.3-2.0x the time at 96 tokens on four of Qwen3.5-9B's and 27B's five projection
# shapes, 3-5x at 4,096). The largest dequantized weight is a term of the planner's reserve
# (hybridkv.sizing.prediction).
DEQUANTIZE_MIN_TOKENS = W4A16_DEQUANTIZE_MIN_TOKENS

# The tensor-core kernel's K shares keep at least this many blocks each.
MIN_BLOCKS_PER_SHARE = 4


def w4a16_gemm_config(num_tokens: int, awq_layout: bool = False, out_features: int = 0) -> dict:
    """Launch configuration by token count and output width. The CUDA-core kernel: compressed-tensors up to
    `GEMV_MAX_TOKENS` tokens, in programs of the next power of two of them (at one token the fastest of the sweep
    on both of Qwen3.5-27B's MLP shapes, block_k input channels per tile in whole groups, K split by `split_k_for`
    unless given); AWQ at one token (rows of 128 contiguous bytes of packed words, not swept). Up to 64 tokens
    otherwise: tensor-core tiles of 128 columns with K split among `split_k` programs per tile, as sweeps on the H200
    found fastest on Qwen3.5-9B's and 27B's projections (group 128): narrow outputs (`WIDE_OUTPUT`) split in eight,
    wide ones in four up to 16 tokens and two beyond. Narrow outputs' token-count classes (1, 2, 3-4, 5-16,
    17-32, 33-64, more) refine the wide ones' (the same to 16, then 17-64, more), so the engine's warm-up, which
    takes its classes from the narrow rule (`out_features` 0) and runs each through every layer, compiles every
    configuration. More tokens (`DEQUANTIZE_MIN_TOKENS`) dequantize the weight for the dense GEMM (`dequantize`);
    with that turned off they take square tiles with K unsplit."""
    wide = out_features > WIDE_OUTPUT
    if awq_layout and num_tokens == 1:
        return {"block_m": 1, "block_n": 256, "block_k": 32, "num_warps": 4, "num_stages": 3}
    if not awq_layout and num_tokens <= GEMV_MAX_TOKENS:
        return {"block_m": next_power_of_2(num_tokens), "block_n": 32, "block_k": 256, "num_warps": 4,
                "num_stages": 1}
    if num_tokens <= 16:
        if wide:
            return {"block_m": 16, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3, "split_k": 4}
        return {"block_m": 16, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": 8}
    if num_tokens <= 32 and not wide:
        return {"block_m": 32, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3, "split_k": 8}
    if num_tokens <= 64:
        return {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3,
                "split_k": 2 if wide else 8}
    # The tiles serve a caller who turns the dequantization off.
    return {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3, "split_k": 1,
            "dequantize": True}


# Dequantization tiles: 64 x 128 weights per program.
_DEQUANTIZE_BLOCK = (64, 128)


def dequantize(qweight, scales, qzeros, group_size: int, awq_layout: bool, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The 4-bit weight as `dtype` in its stored orientation (AWQ `[K, N]`, compressed-tensors `[N, K]`): the
    operand prefill-sized products hand to the dense GEMM."""
    out_features = scales.shape[1] if awq_layout else qweight.shape[0]
    block_n, block_k = _DEQUANTIZE_BLOCK
    shape = (in_features, out_features) if awq_layout else (out_features, in_features)
    weight = torch.empty(shape, dtype=dtype, device=qweight.device)
    zeros = qzeros if qzeros is not None else scales
    _dequantize_kernel[(cdiv(out_features, block_n), cdiv(in_features, block_k))](
        qweight, scales, zeros, weight, out_features, in_features, qweight.stride(0), scales.stride(0),
        zeros.stride(0), weight.stride(0), GROUP=group_size, AWQ=awq_layout, HAS_ZEROS=qzeros is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return weight


def _gemv(x, qweight, scales, zeros, has_zeros, group_size, awq_layout, out_features, tiles, split_k):
    num_tokens, in_features = x.shape
    if awq_layout:
        # The largest power-of-two tile that lies inside one group (groups are multiples of 8).
        block_k = min(tiles["block_k"], group_size & -group_size)
        k_tiles = cdiv(in_features, block_k)
    else:
        # Whole groups per tile, a power of two of them.
        groups_per_tile = 1 << (max(1, tiles["block_k"] // group_size).bit_length() - 1)
        k_tiles = cdiv(cdiv(in_features, group_size), groups_per_tile)
    n_tiles = cdiv(out_features, tiles["block_n"])
    # AWQ: one token per grid row; compressed-tensors: block_m tokens per grid row (one for each token count of a
    # class, so the split below is the class's).
    row_blocks = num_tokens if awq_layout else cdiv(num_tokens, tiles["block_m"])
    split_k = split_k or split_k_for(x.device, row_blocks * n_tiles, k_tiles)
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    grid = (row_blocks, n_tiles, split_k)
    pdl = dependent_launch(x.device)
    if awq_layout:
        out = y if split_k == 1 else torch.empty(split_k, num_tokens, out_features, dtype=torch.float32,
                                                 device=x.device)
        _awq_gemv_kernel[grid](
            x, qweight, scales, zeros, out, out_features, in_features, x.stride(0), qweight.stride(0),
            scales.stride(0), zeros.stride(0), out.stride(-2), out.stride(0) if split_k > 1 else 0, GROUP=group_size,
            BLOCK_N=tiles["block_n"], BLOCK_K=block_k, SPLIT_K=split_k, PDL=pdl, num_warps=tiles["num_warps"],
            num_stages=tiles["num_stages"], launch_pdl=pdl)
        if split_k > 1:
            y.copy_(out.sum(0))
        return y
    shares, counters = split_k_workspace(y, split_k, row_blocks * n_tiles)
    meta = dict(GROUP=group_size, HAS_ZEROS=has_zeros, BLOCK_N=tiles["block_n"], GROUPS_PER_TILE=groups_per_tile,
                WORDS_PAD=next_power_of_2(group_size // 8),
                WHOLE_GROUPS=in_features % group_size == 0 and (group_size // 8) & (group_size // 8 - 1) == 0,
                SPLIT_K=split_k, USE_ASM=not INTERPRETED,
                PEAK_CHUNKS=cdiv(min(cdiv(k_tiles, split_k) * groups_per_tile * group_size,
                                            in_features), _PEAK_CHUNK.value),
                PDL=pdl, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], launch_pdl=pdl)
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0),
               num_tokens * out_features)
    if tiles["block_m"] == 1:
        _packed_along_k_gemv_kernel[grid](x, qweight, scales, zeros, y, shares, counters, out_features, in_features,
                                          *strides, **meta)
    else:
        _packed_along_k_rows_kernel[grid](x, qweight, scales, zeros, y, shares, counters, num_tokens, out_features,
                                          in_features, *strides, ROWS=tiles["block_m"], **meta)
    return y


def w4a16_linear(x, qweight, scales, qzeros, group_size: int, awq_layout: bool, config: dict | None = None):
    """x `[M, K]` times the 4-bit weight's transpose -> `[M, N]` in x's dtype; `config` overrides
    `w4a16_gemm_config` (benchmarks sweep it; block_m 1 is the CUDA-core kernel, whose `split_k` shares K among that
    many programs per output tile, chosen to fill the GPU when not given; `dequantize` True or False picks the dense
    GEMM on the dequantized weight or the tile kernel at any size)."""
    num_tokens, in_features = x.shape
    out_features = scales.shape[1] if awq_layout else qweight.shape[0]
    if num_tokens == 0:
        return torch.empty(0, out_features, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    tiles = {**w4a16_gemm_config(num_tokens, awq_layout, out_features), **(config or {})}
    zeros = qzeros if qzeros is not None else scales
    if tiles.get("dequantize"):
        weight = dequantize(qweight, scales, qzeros, group_size, awq_layout, in_features, x.dtype)
        return x @ (weight if awq_layout else weight.t())
    if tiles["block_m"] < TENSOR_CORE_MIN_ROWS:
        # K's split: the caller's, or one that fills the GPU (never the tensor-core rule's).
        return _gemv(x, qweight, scales, zeros, qzeros is not None, group_size, awq_layout, out_features, tiles,
                     (config or {}).get("split_k"))
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if "block_k" not in (config or {}) and group_size < tiles["block_k"] and group_size % 16 == 0:
        tiles["block_k"] = group_size  # blocks inside one group read its scales and zero points once
    grid_m, grid_n = cdiv(num_tokens, tiles["block_m"]), cdiv(out_features, tiles["block_n"])
    # The caller's split, or the rule's with a few K blocks kept per share (short K splits less): it depends on the
    # weight's shape and the token-count class only, so the warm-up compiles it.
    split_k = (config or {}).get("split_k") or max(1, min(
        tiles.get("split_k", 1), cdiv(in_features, tiles["block_k"]) // MIN_BLOCKS_PER_SHARE))
    shares, counters = split_k_workspace(y, split_k, grid_m * grid_n)
    _w4a16_gemm_kernel[(grid_m, grid_n, split_k)](
        x, qweight, scales, zeros, y, shares, counters, num_tokens, out_features, in_features, x.stride(0),
        qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0), num_tokens * out_features,
        GROUP=group_size, AWQ=awq_layout, HAS_ZEROS=qzeros is not None, BLOCK_M=tiles["block_m"],
        BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"], ONE_GROUP_PER_BLOCK=group_size % tiles["block_k"] == 0,
        FLOAT32_DOT=INTERPRETED, SPLIT_K=split_k, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    return y
