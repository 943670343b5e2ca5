"""4-bit weight, 16-bit activation GEMM in Triton: y = x W^T with W unpacked from int32 words and dequantized in the
kernel, `(q - z) * s` per group of input channels, for both stored layouts (`hybridkv.sizing.quantization`):

- AWQ: qweight `[K, N/8]` and qzeros `[K/G, N/8]` packed along N in AWQ's column order, scales `[K/G, N]`;
- compressed-tensors: weight_packed `[N, ceil(K/8)]` packed along K, scales `[N, ceil(K/G)]`, zero points
  `[ceil(N/8), ceil(K/G)]` packed along N, or none (symmetric: zero 8).

The weight is read once per column tile in its packed form (a quarter of the bf16 bytes), each int32 word once as part
of a contiguous tile: at batch 1 that is a quarter of a bf16 GEMM's traffic, though on the H200 the dequantization
still costs more than the saved reads (docs/performance.md). Reference: `quant_reference.w4a16_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import INTERPRETED


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
            if BLOCK_M == 1:  # one token: multiply and reduce on the CUDA cores, no tensor-core layout to feed
                acc += tl.sum(a.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
            elif FLOAT32_DOT:
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
            if BLOCK_M == 1:
                acc += tl.sum(a.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
            elif FLOAT32_DOT:
                acc += tl.dot(a.to(tl.float32), tl.trans(w))
            else:
                acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    tl.store(y_ptr + rows[:, None] * stride_y_row + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def w4a16_gemm_config(num_tokens: int) -> dict:
    """Tile sizes: decode and up to 64 tokens as bench/kernels.py's --sweep found fastest on the H200 (Qwen3.5-27B's
    gate|up, group 128); prefill tiles are square."""
    if num_tokens <= 16:
        return {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4}
    if num_tokens <= 64:
        return {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3}
    return {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}


def w4a16_linear(x, qweight, scales, qzeros, group_size: int, awq_layout: bool, config: dict | None = None):
    """x `[M, K]` times the 4-bit weight's transpose -> `[M, N]` in x's dtype; `config` overrides
    `w4a16_gemm_config` (benchmarks sweep it)."""
    num_tokens, in_features = x.shape
    out_features = scales.shape[1] if awq_layout else qweight.shape[0]
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    tiles = {**w4a16_gemm_config(num_tokens), **(config or {})}
    if "block_k" not in (config or {}) and group_size < tiles["block_k"] and group_size % 16 == 0:
        tiles["block_k"] = group_size  # blocks inside one group read its scales and zero points once
    zeros = qzeros if qzeros is not None else scales
    grid = (triton.cdiv(num_tokens, tiles["block_m"]), triton.cdiv(out_features, tiles["block_n"]))
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, y, num_tokens, out_features, in_features, x.stride(0), qweight.stride(0),
        scales.stride(0), zeros.stride(0), y.stride(0), GROUP=group_size, AWQ=awq_layout,
        HAS_ZEROS=qzeros is not None, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"],
        ONE_GROUP_PER_BLOCK=group_size % tiles["block_k"] == 0, FLOAT32_DOT=INTERPRETED,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    return y
