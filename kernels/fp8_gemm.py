"""Block-scaled FP8 GEMM in Triton: y = x W^T with W float8_e4m3fn `[N, K]` and one float32 `weight_scale_inv` per
128 x 128 block, activations quantized to e4m3 per token and per 128 input channels on the fly.

Two kernels: the first writes x's e4m3 values and per-group scales (a program per group of 128 channels, for one token
or sixteen), the second walks K one scale block at a time, multiplying e4m3 tiles on the tensor cores and scaling each
partial product by the token-group scale times the weight block's scale; on Hopper its tiles are copied by the tensor
memory accelerator (`uses_tma`). In the engine the first is usually not launched: the norm or SwiGLU that writes x
writes it quantized too (`attach_quantized`). Reference: `quant_reference.fp8_linear`.

Prefill-sized products (`CUBLAS_MIN_TOKENS` and more) go to cuBLASLt's block-scaled FP8 GEMM instead where the GPU and
torch have it (`torch._scaled_mm` with 1 x 128 activation scales and 128 x 128 weight scales: Hopper, through the
same activation kernel writing its scales column by column), as other engines hand these shapes to CUTLASS: at
thousands of tokens a block-scaled product is bound by how the scaling is overlapped with the tensor-core work, which
the library's warp-specialized kernels do and a Triton tile loop does not.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hybridkv.sizing.quantization import E4M3_MAX

from .quant_reference import MIN_AMAX
from .triton_utils import (INTERPRETED, cdiv, finish_split_k, hopper_or_later, round_to_e4m3_grid, split_k_for,
                           split_k_workspace)


@triton.jit
def quantized_group(x, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """Float32 rows `[R, GROUP]` of one channel group -> (their scales `[R]`, the values over their scale clamped to
    e4m3's range, still float32): the activations' quantization, here and in the kernels that write activations
    already quantized (`hybridkv.kernels.elementwise`)."""
    scale = tl.maximum(tl.max(tl.abs(x), 1), AMAX_FLOOR) / FP8_MAX
    return scale, tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)


@triton.jit(do_not_specialize=["M", "rows"])
def _quantize_activations_kernel(x_ptr, q_ptr, s_ptr, M, rows, K, stride_x_row, stride_q_row, stride_s_row,
                                 stride_s_group, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                                 FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, ROUND_IN_FLOAT32: tl.constexpr):
    # Program (r, g): rows r * BLOCK_ROWS onwards, channel group g. Rows from M to `rows` (padding to a multiple the
    # GEMM takes) come out as zeros.
    offs_r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    in_k = (offs < K)[None, :]
    x = tl.load(x_ptr + offs_r[:, None] * stride_x_row + offs[None, :], mask=(offs_r < M)[:, None] & in_k,
                other=0.0).to(tl.float32)
    scale, q = quantized_group(x, FP8_MAX, AMAX_FLOOR)
    if ROUND_IN_FLOAT32:
        # The interpreter's float32 -> e4m3 cast mis-rounds values that round up into the next power of two; a value
        # already on the grid converts exactly.
        q = round_to_e4m3_grid(q)
    live = offs_r < rows
    tl.store(q_ptr + offs_r[:, None] * stride_q_row + offs[None, :], q.to(q_ptr.dtype.element_ty),
             mask=live[:, None] & in_k)
    tl.store(s_ptr + offs_r * stride_s_row + group * stride_s_group, scale, mask=live)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, shares_ptr, counters_ptr, M, N, K, stride_q_row,
                     stride_xs_row, stride_w_row, stride_ws_row, stride_y_row, stride_share, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
                     ONE_SCALE_COLUMN: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                     FLOAT32_DOT: tl.constexpr, SPLIT_K: tl.constexpr, TMA: tl.constexpr):
    # Output tiles are numbered in groups of GROUP_M row tiles sharing a column tile, so the programs running at
    # once read the same weight columns while they are in L2. A column tile inside one weight scale block
    # (ONE_SCALE_COLUMN) reads one scale per K block and scales each partial product by one factor per row (a
    # fused multiply-add per element). With SPLIT_K > 1, program (tile, ., s) covers the s-th share of the scale
    # blocks along K, and the tile's last share in sums them (finish_split_k). With TMA, q_ptr and w_ptr are tensor
    # descriptors of the activations and the weight: the tiles are copied by the tensor memory accelerator into
    # the pipeline's shared-memory stages (rows and channels past the ends read as zeros), no thread computing
    # addresses or holding a load in flight.
    m_tiles = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    group_first_m = (tile // (GROUP_M * tl.cdiv(N, BLOCK_N))) * GROUP_M
    group_rows = tl.minimum(m_tiles - group_first_m, GROUP_M)
    pid_m = group_first_m + (tile % (GROUP_M * tl.cdiv(N, BLOCK_N))) % group_rows
    pid_n = (tile % (GROUP_M * tl.cdiv(N, BLOCK_N))) // group_rows
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    first_k_block = tl.program_id(2) * per_split
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_block in range(first_k_block, tl.minimum(first_k_block + per_split, k_blocks)):
        if TMA:
            a = q_ptr.load([pid_m * BLOCK_M, k_block * BLOCK_K])
            b = w_ptr.load([pid_n * BLOCK_N, k_block * BLOCK_K]).T
        else:
            offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a_mask = mask_m[:, None]
                b_mask = mask_n[None, :]
            else:
                a_mask = mask_m[:, None] & (offs_k < K)[None, :]
                b_mask = (offs_k < K)[:, None] & mask_n[None, :]
            a = tl.load(q_ptr + rows[:, None] * stride_q_row + offs_k[None, :], mask=a_mask, other=0.0)
            b = tl.load(w_ptr + cols[None, :] * stride_w_row + offs_k[:, None], mask=b_mask, other=0.0)
        if FLOAT32_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        a_scale = tl.load(xs_ptr + rows * stride_xs_row + k_block, mask=mask_m, other=0.0)
        if ONE_SCALE_COLUMN:
            b_scale = tl.load(ws_ptr + ((pid_n * BLOCK_N) // SCALE_ROWS) * stride_ws_row + k_block)
            acc += tl.dot(a, b) * (a_scale * b_scale)[:, None]
        else:
            b_scale = tl.load(ws_ptr + (offs_n // SCALE_ROWS) * stride_ws_row + k_block, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    offsets = rows[:, None] * stride_y_row + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        finish_split_k(acc, y_ptr + offsets, shares_ptr + rows[:, None] * N + offs_n[None, :], stride_share,
                       counters_ptr + tile, tl.program_id(2), mask, SPLIT_K)


def fp8_gemm_config(num_tokens: int, out_features: int = 0, tma: bool = False) -> dict:
    """Tile sizes, the fastest of bench/kernel_speed.py's --sweep on the H200 at Qwen3.5-27B's MLP shapes (gate|up
    17408 x 5120 and down 5120 x 17408): 16-row tiles and narrow column tiles for decode-sized batches (the weight
    read dominates), 64 x 128 in groups of eight row tiles for prefill where cuBLASLt's block-scaled GEMM is not
    available (one weight scale per K block, the same weight columns in L2 for the programs running at once). Up to
    64 tokens K is shared among programs when the column tiles alone leave multiprocessors idle (the down
    projection's 80 to 160); the shares are summed in the kernel. At 17-64 tokens narrow outputs (`WIDE_OUTPUT`
    columns or fewer, whose K is long) loaded through pointers (`tma` False) keep three stages in flight rather
    than four (35.8 against 38.1 µs on the down projection at 64 tokens); through the tensor memory accelerator
    they take K in three shares of six stages each, at most two programs per multiprocessor (31.0 against 33.4 µs
    on Qwen3.5-27B's down projection at 64 tokens, 20.3 against 20.6 on 9B's, of 120 tile, stage and split
    configurations), and four stages were the fastest everywhere else. The token-count classes are the same for
    every width."""
    if num_tokens <= 16:
        return {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 4, "split_k": 0, "tma": tma}
    if num_tokens <= 64:
        if tma and out_features <= WIDE_OUTPUT:
            return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 6, "split_k": 3, "tma": tma}
        stages = 4 if tma or out_features > WIDE_OUTPUT else 3
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": stages, "split_k": 0, "tma": tma}
    return {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 4, "group_m": 8, "tma": tma}


# The attribute under which a kernel that wrote activations also leaves them quantized: (group, values, scales).
_QUANTIZED_ATTRIBUTE = "_fp8_quantized"


def attach_quantized(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, group: int) -> None:
    """Record on x `[M, K]` its e4m3 values `[M, K]` and float32 scales `[M, ceil(K / group)]` per token and group
    of `group` channels, as `quantize_activations` would make them (the kernel that writes x writes them too):
    `Fp8Activations` of x then launches no quantization. A view or copy of x does not carry them."""
    setattr(x, _QUANTIZED_ATTRIBUTE, (group, values, scales))


class Fp8Activations:
    """x `[M, K]` quantized once for several FP8 products on it (the checkpoint projections of a merged projection):
    each layout the two paths read is made on first use, per token and group of `group` channels, unless the
    kernel that wrote x left it quantized in the Triton kernel's layout (`attach_quantized`)."""

    def __init__(self, x: torch.Tensor, group: int):
        self.x = x if x.stride(1) == 1 else x.contiguous()
        self.group = group
        attached = getattr(x, _QUANTIZED_ATTRIBUTE, None)
        self._by_row = attached[1:] if attached is not None and attached[0] == group else None
        self._for_cublas = None

    def by_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values `[M, K]`, scales `[M, groups]`), the Triton kernel's layout."""
        if self._by_row is None:
            self._by_row = quantize_activations(self.x, self.group)
        return self._by_row

    def for_cublas(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows padded to `CUBLAS_ROW_MULTIPLE` with zeros, scales stored column by column (cuBLASLt's layout)."""
        if self._for_cublas is None:
            rows = cdiv(self.x.shape[0], CUBLAS_ROW_MULTIPLE) * CUBLAS_ROW_MULTIPLE
            self._for_cublas = quantize_activations(self.x, self.group, rows, scales_by_column=True)
        return self._for_cublas


def fp8_linear(x, weight, weight_scale_inv, block_size, config: dict | None = None,
               activations: Fp8Activations | None = None):
    """x `[M, K]` times the block-scaled FP8 weight `[N, K]` transposed -> `[M, N]` in x's dtype; `config` overrides
    `fp8_gemm_config` (benchmarks sweep it; its `split_k` shares K among that many programs per output tile, 0 as
    many as `split_k_for` gives). Without `config`, products `uses_cublas` accepts go to cuBLASLt; with one, the
    Triton kernel runs. `activations`: x already quantized (`Fp8Activations` of this x and block_size[1])."""
    scale_rows, scale_cols = block_size
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    if num_tokens == 0:
        return torch.empty(0, out_features, dtype=x.dtype, device=x.device)
    activations = activations if activations is not None else Fp8Activations(x, scale_cols)
    if config is None and uses_cublas(num_tokens, weight, weight_scale_inv, block_size):
        return cublas_fp8_linear(x, weight, weight_scale_inv, activations)
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    groups = cdiv(in_features, scale_cols)
    tiles = {**fp8_gemm_config(num_tokens, out_features, uses_tma(weight, block_size)), **(config or {})}
    values, scales = activations.by_row()
    operands = (values, weight)
    if tiles["tma"]:
        operands = (TensorDescriptor.from_tensor(values, [tiles["block_m"], scale_cols]),
                    TensorDescriptor.from_tensor(weight, [tiles["block_n"], scale_cols]))
    m_tiles, n_tiles = cdiv(num_tokens, tiles["block_m"]), cdiv(out_features, tiles["block_n"])
    split_k = min(tiles.get("split_k", 1) or split_k_for(x.device, m_tiles * n_tiles, groups, programs_per_sm=2),
                  groups)
    shares, counters = split_k_workspace(y, split_k, m_tiles * n_tiles)
    grid = (m_tiles * n_tiles, 1, split_k)
    _fp8_gemm_kernel[grid](
        operands[0], scales, operands[1], weight_scale_inv, y, shares, counters, num_tokens, out_features, in_features,
        values.stride(0), scales.stride(0), weight.stride(0), weight_scale_inv.stride(0), y.stride(0),
        num_tokens * out_features, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], BLOCK_K=scale_cols,
        SCALE_ROWS=scale_rows, ONE_SCALE_COLUMN=scale_rows % tiles["block_n"] == 0, GROUP_M=tiles.get("group_m", 1),
        EVEN_K=in_features % scale_cols == 0, FLOAT32_DOT=INTERPRETED, SPLIT_K=split_k, TMA=tiles["tma"],
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    return y


def quantize_activations(x, group: int, rows: int | None = None, scales_by_column: bool = False):
    """x `[M, K]` -> e4m3 values `[rows, K]` and float32 scales `[rows, ceil(K / group)]` per token and group, rows
    M onwards zero (`rows` defaults to M); with `scales_by_column` the scales are stored column by column (stride 1
    along the rows), the layout cuBLASLt reads 1 x 128 scales in."""
    num_tokens, in_features = x.shape
    rows = num_tokens if rows is None else rows
    groups = cdiv(in_features, group)
    values = torch.empty(rows, in_features, dtype=torch.float8_e4m3fn, device=x.device)
    if scales_by_column:
        scales = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    # 16 rows a program from 16 rows on (the loads in flight a prefill's activations need), else one: two
    # specializations, both compiled by the engine's warm-up (decode and prefill steps).
    block_rows = 16 if rows >= 16 else 1
    _quantize_activations_kernel[(cdiv(rows, block_rows), groups)](
        x, values, scales, num_tokens, rows, in_features, x.stride(0), values.stride(0), scales.stride(0),
        scales.stride(1), GROUP=group, BLOCK_ROWS=block_rows, FP8_MAX=E4M3_MAX, AMAX_FLOOR=MIN_AMAX,
        ROUND_IN_FLOAT32=INTERPRETED, num_warps=4 if block_rows >= 8 else 1,
    )
    return values, scales


# Outputs wider than this count as wide in `fp8_gemm_config` (the MLP's gate|up; down and output projections are
# narrower).
WIDE_OUTPUT = 8192

# From this many tokens cuBLASLt's block-scaled GEMM is faster than the Triton tiles on the H200 at Qwen3.5-27B's
# MLP shapes (1.26x bf16 against the tiles' 1.03x at 128 tokens; at 64 the tiles' 1.58x against 1.24x).
CUBLAS_MIN_TOKENS = 65
# cuBLASLt takes the activations in whole 16-row tiles: the rows are padded to a multiple of this with zeros.
CUBLAS_ROW_MULTIPLE = 16


def uses_tma(weight, block_size) -> bool:
    """Whether the Triton kernel loads its tiles through the tensor memory accelerator (Hopper and later): the
    weight row-major at a 16-byte aligned address with 16-byte rows, K a multiple of 16 (the activations' rows) and
    K blocks of at most 128 bytes (one swizzled shared-memory row). On the H200 this took 27.5 against 29.6 µs on
    Qwen3.5-27B's gate projection at 64 tokens, 29.3 against 31.3 on 9B's gate|up and 20.5 against 22.2 on its
    down projection, and the same as pointer loads at 1-16 tokens."""
    if INTERPRETED or not weight.is_cuda or weight.stride(1) != 1 or block_size[1] > 128:
        return False
    if weight.stride(0) % 16 or weight.shape[1] % 16 or weight.data_ptr() % 16:
        return False
    return hopper_or_later(weight.device.index)


def uses_cublas(num_tokens: int, weight, weight_scale_inv, block_size) -> bool:
    """Whether `fp8_linear` hands this product to cuBLASLt: a CUDA device that has the block-scaled GEMM, at least
    `CUBLAS_MIN_TOKENS` tokens, 128 x 128 weight blocks and the alignments cuBLASLt asks for (the weight row-major,
    16-byte rows of weight scales, so K a multiple of 512, and N a multiple of 16)."""
    if INTERPRETED or not weight.is_cuda or num_tokens < CUBLAS_MIN_TOKENS or tuple(block_size) != (128, 128):
        return False
    out_features, in_features = weight.shape
    if in_features % 512 or out_features % 16 or weight.stride(1) != 1 or not weight_scale_inv.is_contiguous():
        return False
    return cublas_block_scaled_available(weight.device.index)


@functools.cache
def cublas_block_scaled_available(device_index: int) -> bool:
    """Whether torch's `_scaled_mm` takes 1 x 128 by 128 x 128 block scales on this GPU (cuBLASLt has them on
    Hopper; elsewhere, or with an older torch, it refuses them), found by one small product."""
    device = torch.device("cuda", device_index)
    try:
        values = torch.zeros(CUBLAS_ROW_MULTIPLE, 512, dtype=torch.float8_e4m3fn, device=device)
        weight = torch.zeros(128, 512, dtype=torch.float8_e4m3fn, device=device)
        scales = torch.ones(4, CUBLAS_ROW_MULTIPLE, dtype=torch.float32, device=device).t()
        torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=torch.ones(1, 4, device=device).t(),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def cublas_fp8_linear(x, weight, weight_scale_inv, activations: Fp8Activations | None = None):
    """`fp8_linear` on cuBLASLt, for products `uses_cublas` accepts (128 x 128 blocks)."""
    num_tokens = x.shape[0]
    values, scales = (activations if activations is not None else Fp8Activations(x, 128)).for_cublas()
    y = torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=weight_scale_inv.t(), out_dtype=x.dtype)
    return y if values.shape[0] == num_tokens else y[:num_tokens]
