"""One-token bf16/fp16 projection `y = x W^T` on the CUDA cores: a batch-1 decode step's GEMV.

At one token a projection reads its weight once and does two flops a byte, so it runs at the rate the weight streams
in. cuBLAS picks GEMM tiles for it (nvjet kernels), and on the small projections of the 0.8B-4B models (2-17 MB each)
those reached 1.5-2.1 TB/s of an H100's 3.0 (docs/performance.md), launch ramp and tail included. Here each program
walks `BLOCK_N` output rows' contiguous weights in `BLOCK_K`-wide tiles, one tile ahead of its products (Triton does not
pipeline a loop without a dot), multiplying in float32 into an accumulator shaped like the tile and summing its rows
once at the end. Too few row blocks to give every multiprocessor `PROGRAMS_PER_SM` programs share each row block's K
walk (`split_k_for`); the last share to finish sums the others in share order (`finish_split_k`), so the result does
not depend on which finished first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_utils import (cdiv, dependent_launch, finish_split_k, release_dependents, split_k_for,
                           split_k_workspace, wait_for_producer)


@dataclass(frozen=True)
class GemvLaunch:
    block_n: int
    block_k: int
    num_warps: int
    programs_per_sm: int


# From bench/kernel_speed.py --only=gemv --sweep on an H100 (2026-12-06): the fewer the output rows, the fewer rows a
# program and the longer its tiles. Up to `NARROW_MAX_OUT_FEATURES` outputs (0.8B's output and down projections, the
# MoE router) four rows in tiles of 1,024 input channels; up to `LONG_TILE_MAX_OUT_FEATURES` eight rows in tiles of
# 512; wider projections eight rows in tiles of 256.
NARROW_MAX_OUT_FEATURES = 1024
LONG_TILE_MAX_OUT_FEATURES = 4096


def launch_for(out_features: int) -> GemvLaunch:
    if out_features <= NARROW_MAX_OUT_FEATURES:
        return GemvLaunch(block_n=4, block_k=1024, num_warps=4, programs_per_sm=4)
    block_k = 512 if out_features <= LONG_TILE_MAX_OUT_FEATURES else 256
    return GemvLaunch(block_n=8, block_k=block_k, num_warps=4, programs_per_sm=4)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, shares_ptr, counters_ptr, N, K, stride_w_row, stride_share,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w_row
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_share = tl.cdiv(k_tiles, SPLIT_K)
    first = tl.program_id(1) * per_share
    last = tl.minimum(first + per_share, k_tiles)
    offs_k = tl.arange(0, BLOCK_K)
    # Columns of this share end at `end` (a share past the last tile has none).
    end = tl.minimum(last * BLOCK_K, K)
    cols = first * BLOCK_K + offs_k
    # The first weight tile is asked for before the input exists: launched dependently, that load overlaps the
    # kernel that writes x.
    w_ahead = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & (cols[None, :] < end), other=0.0)
    wait_for_producer(PDL)
    x_ahead = tl.load(x_ptr + cols, mask=cols < end, other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for tile in range(first, last):
        w, x = w_ahead, x_ahead
        cols = (tile + 1) * BLOCK_K + offs_k
        w_ahead = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & (cols[None, :] < end), other=0.0)
        x_ahead = tl.load(x_ptr + cols, mask=cols < end, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    release_dependents(PDL)
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        finish_split_k(y, y_ptr + offs_n, shares_ptr + offs_n, stride_share, counters_ptr + tl.program_id(0),
                       tl.program_id(1), mask_n, SPLIT_K)


def gemv(x: torch.Tensor, weight: torch.Tensor, launch: GemvLaunch | None = None) -> torch.Tensor:
    """`x @ weight.T` for one row: x `[1, K]`, weight `[N, K]` (its rows contiguous) -> `[1, N]` in x's dtype,
    summed in float32."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv takes x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs each weight row contiguous (stride 1 along K)")
    out_features, in_features = weight.shape
    launch = launch or launch_for(out_features)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    row_blocks = cdiv(out_features, launch.block_n)
    split_k = split_k_for(x.device, row_blocks, cdiv(in_features, launch.block_k), launch.programs_per_sm)
    shares, counters = split_k_workspace(y, split_k, row_blocks)
    pdl = dependent_launch(x.device)
    _gemv_kernel[(row_blocks, split_k)](
        x, weight, y, shares, counters, out_features, in_features, weight.stride(0), out_features,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SPLIT_K=split_k, PDL=pdl, num_warps=launch.num_warps,
        launch_pdl=pdl,
    )
    return y
