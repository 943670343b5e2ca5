"""One-token bf16/fp16 projection `y = x W^T` on the CUDA cores: a batch-1 decode step's GEMV.

At one token a projection reads its weight once and does two flops a byte, so it runs at the rate the weight streams
in. cuBLAS picks GEMM tiles for it (nvjet kernels), and on the small projections of the 0.8B-4B models (2-17 MB each)
those reached 1.5-2.1 TB/s of an H100's 3.0 (docs/performance.md), launch ramp and tail included. Here each program
walks `BLOCK_N` output rows' contiguous weights in `BLOCK_K`-wide tiles, one tile ahead of its products (Triton does not
pipeline a loop without a dot), multiplying in float32 into an accumulator shaped like the tile and summing its rows
once at the end. Too few row blocks to give every multiprocessor `PROGRAMS_PER_SM` programs share each row block's K
walk (`split_k_for`); the last share to finish sums the others in share order (`finish_split_k`), so the result does
not depend on which finished first.

The kernel that writes a projection's input can be folded into the GEMV's reads of it (`Prologue`): SwiGLU before
the MLP's down projection, Gated DeltaNet's per-head gated RMSNorm before its output projection, and attention's
sigmoid output gate before its own. Each program computes the activated input of its own tiles, rounded where the
separate kernel rounds its output, so a batch-1 step launches one kernel where it launched two (three for the gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import triton
import triton.language as tl

from .triton_utils import (cdiv, dependent_launch, early_release, finish_split_k, release_after_wait, release_at_start,
                           split_k_for, split_k_workspace, wait_for_producer)


@dataclass(frozen=True)
class GemvLaunch:
    block_n: int
    block_k: int
    num_warps: int
    programs_per_sm: int


# From a sweep on an H100 of the 0.8B's and 4B's projections, each with the prologue the model gives it, and the
# engine's batch-1 decode steps with the chosen rule (2026-12-07, docs/performance.md): tiles of 1,024 input channels
# everywhere. Up to `NARROW_MAX_OUT_FEATURES` outputs (0.8B's output and down projections, the MoE router) and for
# inputs of up to `SHORT_INPUT_MAX_FEATURES` channels, four rows a program; wider projections of longer inputs eight.
# A narrow projection of a long input (0.8B's down projection, 3,584 channels) takes tiles of 2,048: half the trips
# to memory.
NARROW_MAX_OUT_FEATURES = 1024
SHORT_INPUT_MAX_FEATURES = 1024
TILE_K = 1024
LONG_TILE_K = 2048


def launch_for(out_features: int, in_features: int) -> GemvLaunch:
    if out_features <= NARROW_MAX_OUT_FEATURES:
        return GemvLaunch(block_n=4, block_k=LONG_TILE_K if in_features > LONG_TILE_K else TILE_K, num_warps=4,
                          programs_per_sm=4)
    return GemvLaunch(block_n=4 if in_features <= SHORT_INPUT_MAX_FEATURES else 8, block_k=TILE_K, num_warps=4,
                      programs_per_sm=4)


# A GEMV lets the next kernel start at its own start (`triton_utils.release_at_start`) only for weights under this
# size. Measured on an H100 in the engine's batch-1 decode steps (2026-12-07, docs/performance.md): the 0.8B's
# projections (4-17 MB) gained from it (0.92 -> 0.90 ms a step), the 4B's (47-94 MB) lost (3.32 -> 3.45 ms).
EARLY_RELEASE_MAX_BYTES = 32 << 20


class Prologue(IntEnum):
    """What the GEMV does to its input as it reads it (`x` below is the GEMV's input row; K its length)."""

    PLAIN = 0  # x as it is
    SWIGLU = 1  # x is [gate | up] of length 2K: silu(gate) * up
    GATED_NORM = 2  # x is K / D heads of D: each head RMS-normed, times the norm weight, times silu of a gate
    SIGMOID_GATE = 3  # x times the sigmoid of a gate


@triton.jit
def _input_tile(x_ptr, gate_ptr, norm_weight_ptr, cols, mask, K, stride_gate_head, eps, PROLOGUE: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns `cols` of the GEMV's input in float32, after the prologue, rounded to the input dtype where the kernel
    the prologue replaces rounds its output (`elementwise` and torch's sigmoid and product). A tile holds whole
    heads for GATED_NORM (BLOCK_K a multiple of HEAD_DIM, K of HEAD_DIM)."""
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        up = tl.load(x_ptr + K + cols, mask=mask, other=0.0).to(tl.float32)
        activated = (x * tl.sigmoid(x)).to(dtype).to(tl.float32)
        x = (activated * up).to(dtype).to(tl.float32)
    elif PROLOGUE >= 2:
        gate = tl.load(gate_ptr + (cols // HEAD_DIM) * stride_gate_head + cols % HEAD_DIM, mask=mask,
                       other=0.0).to(tl.float32)
        if PROLOGUE == 2:
            heads = tl.reshape(x, (BLOCK_K // HEAD_DIM, HEAD_DIM))
            heads = heads / tl.sqrt(tl.sum(heads * heads, axis=1) / HEAD_DIM + eps)[:, None]
            weight = tl.load(norm_weight_ptr + cols % HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
            normed = (weight * tl.reshape(heads, (BLOCK_K,)).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x = (normed * gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        else:
            x = (x * tl.sigmoid(gate).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, shares_ptr, counters_ptr, gate_ptr, norm_weight_ptr, N, K, stride_w_row,
                 stride_share, stride_gate_head, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, PROLOGUE: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
                 EARLY: tl.constexpr):
    release_at_start(PDL, EARLY)
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
    x_ahead = _input_tile(x_ptr, gate_ptr, norm_weight_ptr, cols, cols < end, K, stride_gate_head, eps, PROLOGUE,
                          HEAD_DIM, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for tile in range(first, last):
        w, x = w_ahead, x_ahead
        cols = (tile + 1) * BLOCK_K + offs_k
        w_ahead = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & (cols[None, :] < end), other=0.0)
        x_ahead = _input_tile(x_ptr, gate_ptr, norm_weight_ptr, cols, cols < end, K, stride_gate_head, eps,
                              PROLOGUE, HEAD_DIM, BLOCK_K)
        acc += w.to(tl.float32) * x[None, :]
    release_after_wait(PDL, EARLY)
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        finish_split_k(y, y_ptr + offs_n, shares_ptr + offs_n, stride_share, counters_ptr + tl.program_id(0),
                       tl.program_id(1), mask_n, SPLIT_K)


def gemv(x: torch.Tensor, weight: torch.Tensor, launch: GemvLaunch | None = None) -> torch.Tensor:
    """`x @ weight.T` for one row: x `[1, K]`, weight `[N, K]` (its rows contiguous) -> `[1, N]` in x's dtype,
    summed in float32."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    return _launch(x.contiguous(), weight, x.shape[1], launch, Prologue.PLAIN)


def swiglu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, launch: GemvLaunch | None = None) -> torch.Tensor:
    """`silu(gate) * up @ weight.T` for one row of a merged `[gate | up]` projection `[1, 2K]`, weight `[N, K]`."""
    if gate_up.dim() != 2 or gate_up.shape[0] != 1 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu_gemv takes one [gate | up] row [1, 2K], got {tuple(gate_up.shape)}")
    return _launch(gate_up.contiguous(), weight, gate_up.shape[1] // 2, launch, Prologue.SWIGLU)


def gated_norm_gemv(core: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, launch: GemvLaunch | None = None) -> torch.Tensor:
    """`gated_rms_norm(core, gate, norm_weight, eps)` flattened, `@ weight.T`, for one token's heads: core and gate
    `[1, H, D]` (the gate's heads may be strided), norm_weight `[D]`, weight `[N, H * D]`."""
    heads, head_dim = _heads(core, gate, "gated_norm_gemv")
    if norm_weight.shape != (head_dim,):
        raise ValueError(f"gated_norm_gemv takes a norm weight [{head_dim}], got {tuple(norm_weight.shape)}")
    launch = _whole_heads(launch or launch_for(weight.shape[0], heads * head_dim), head_dim)
    return _launch(core.contiguous().view(1, heads * head_dim), weight, heads * head_dim, launch,
                   Prologue.GATED_NORM, gate, norm_weight.contiguous(), eps, head_dim)


def sigmoid_gated_gemv(core: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       launch: GemvLaunch | None = None) -> torch.Tensor:
    """`core * sigmoid(gate)` flattened, `@ weight.T`, for one token's heads: core and gate `[1, H, D]` (the gate's
    heads may be strided), weight `[N, H * D]`."""
    heads, head_dim = _heads(core, gate, "sigmoid_gated_gemv")
    return _launch(core.contiguous().view(1, heads * head_dim), weight, heads * head_dim, launch,
                   Prologue.SIGMOID_GATE, gate, head_dim=head_dim)


def _heads(core: torch.Tensor, gate: torch.Tensor, name: str) -> tuple[int, int]:
    if core.dim() != 3 or core.shape[0] != 1 or gate.shape != core.shape:
        raise ValueError(f"{name} takes core and gate [1, H, D], got {tuple(core.shape)} and {tuple(gate.shape)}")
    if gate.stride(-1) != 1:
        raise ValueError(f"{name} needs the gate's head dim contiguous")
    return core.shape[1], core.shape[2]


def _whole_heads(launch: GemvLaunch, head_dim: int) -> GemvLaunch:
    """`launch` with K tiles that hold whole heads of `head_dim` (a power of two), for the per-head norm."""
    if launch.block_k % head_dim == 0:
        return launch
    return GemvLaunch(launch.block_n, head_dim * cdiv(launch.block_k, head_dim), launch.num_warps,
                      launch.programs_per_sm)


def _launch(x: torch.Tensor, weight: torch.Tensor, in_features: int, launch: GemvLaunch | None, prologue: Prologue,
            gate: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            head_dim: int = 1) -> torch.Tensor:
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"the GEMV's weight must be [N, {in_features}], got {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs each weight row contiguous (stride 1 along K)")
    out_features = weight.shape[0]
    launch = launch or launch_for(out_features, in_features)
    y = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    row_blocks = cdiv(out_features, launch.block_n)
    split_k = split_k_for(x.device, row_blocks, cdiv(in_features, launch.block_k), launch.programs_per_sm)
    shares, counters = split_k_workspace(y, split_k, row_blocks)
    pdl = dependent_launch(x.device)
    _gemv_kernel[(row_blocks, split_k)](
        x, weight, y, shares, counters, gate if gate is not None else x,
        norm_weight if norm_weight is not None else x, out_features, in_features, weight.stride(0), out_features,
        gate.stride(1) if gate is not None else 0, eps, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        SPLIT_K=split_k, PROLOGUE=int(prologue), HEAD_DIM=head_dim, PDL=pdl,
        EARLY=early_release(x.device) and weight.numel() * weight.element_size() < EARLY_RELEASE_MAX_BYTES,
        num_warps=launch.num_warps,
        launch_pdl=pdl,
    )
    return y
