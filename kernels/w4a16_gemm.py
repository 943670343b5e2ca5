"""4-bit weight, 16-bit activation GEMM in Triton: y = x W^T with W unpacked from int32 words and dequantized in the
kernel, `(q - z) * s` per group of input channels, for both stored layouts (`hybridkv.sizing.quantization`):

- AWQ: qweight `[K, N/8]` and qzeros `[K/G, N/8]` packed along N in AWQ's column order, scales `[K/G, N]`;
- compressed-tensors: weight_packed `[N, ceil(K/8)]` packed along K, scales `[N, ceil(K/G)]`, zero points
  `[ceil(N/8), ceil(K/G)]` packed along N, or none (symmetric: zero 8).

The weight is read once per column tile in its packed form (a quarter of the bf16 bytes), which is what makes batch-1
decode faster than a bf16 GEMM. Reference: `quant_reference.w4a16_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import INTERPRETED


@triton.jit
def _awq_nibble_shift(column):
    # Column c of a group of 8 sits in nibble (c // 2) + 4 (c % 2): AutoAWQ packs in the order 0 2 4 6 1 3 5 7.
    c = column % 8
    return ((c // 2) + (c % 2) * 4) * 4


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_x_row, stride_qw_row, stride_s_row,
                       stride_z_row, stride_y_row, GROUP: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ONE_GROUP_PER_BLOCK: tl.constexpr, FLOAT32_DOT: tl.constexpr):
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
        mask_kn = mask_k[:, None] & mask_n[None, :]
        if ONE_GROUP_PER_BLOCK:
            # The block lies inside one group: its scales and zero points are one row of BLOCK_N, read once (as a
            # [BLOCK_K, BLOCK_N] gather they would be pipelined through shared memory BLOCK_K times over).
            groups = k_start // GROUP
            group_rows = None
            mask_groups = mask_n[None, :]
        else:
            groups = offs_k // GROUP
            group_rows = groups[:, None]
            mask_groups = mask_kn
        if AWQ:
            shift = _awq_nibble_shift(offs_n)[None, :]
            words = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * stride_qw_row + (cols // 8)[None, :],
                            mask=mask_kn, other=0)
            q = (words >> shift) & 0xF
            if ONE_GROUP_PER_BLOCK:
                zero_words = tl.load(z_ptr + groups * stride_z_row + (cols // 8)[None, :], mask=mask_groups, other=0)
                scales = tl.load(s_ptr + groups * stride_s_row + cols[None, :], mask=mask_groups, other=0.0)
            else:
                zero_words = tl.load(z_ptr + group_rows * stride_z_row + (cols // 8)[None, :], mask=mask_groups,
                                     other=0)
                scales = tl.load(s_ptr + group_rows * stride_s_row + cols[None, :], mask=mask_groups, other=0.0)
            zeros = (zero_words >> shift) & 0xF
        else:
            words = tl.load(qw_ptr + cols[None, :] * stride_qw_row + (offs_k // 8)[:, None], mask=mask_kn, other=0)
            q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
            if ONE_GROUP_PER_BLOCK:
                scale_offsets = cols[None, :] * stride_s_row + groups
                zero_offsets = (cols // 8)[None, :] * stride_z_row + groups
            else:
                scale_offsets = cols[None, :] * stride_s_row + group_rows
                zero_offsets = (cols // 8)[None, :] * stride_z_row + group_rows
            if HAS_ZEROS:
                zero_words = tl.load(z_ptr + zero_offsets, mask=mask_groups, other=0)
                zeros = (zero_words >> ((offs_n % 8) * 4)[None, :]) & 0xF
            else:
                zeros = 8
            scales = tl.load(s_ptr + scale_offsets, mask=mask_groups, other=0.0)
        a = tl.load(x_ptr + rows[:, None] * stride_x_row + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = (q - zeros).to(tl.float32) * scales.to(tl.float32)
        if FLOAT32_DOT:
            acc += tl.dot(a.to(tl.float32), w)
        else:
            acc += tl.dot(a, w.to(a.dtype))
    tl.store(y_ptr + rows[:, None] * stride_y_row + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def w4a16_gemm_config(num_tokens: int) -> dict:
    """Tile sizes: narrow 16-row tiles and many column tiles at decode, square tiles for prefill."""
    if num_tokens <= 16:
        return {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}
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
