"""Fused mixture-of-experts feed-forward in Triton: a grouped GEMM over (token, choice) rows sorted by expert.

Three steps, none of which reads a device value on the host (decode steps are captured in CUDA graphs):
1. `align_by_expert`: the T*k (token, choice) rows are sorted by expert and each expert's run is padded to a
   multiple of BLOCK_M, so every block of BLOCK_M sorted rows belongs to one expert. The buffers are sized for the
   worst case, `T*k + min(E, T*k) * (BLOCK_M - 1)` rows; blocks past the real padded length return at once. Up to
   `ONE_LAUNCH_ALIGN_ROWS` rows (decode) one Triton program does it in a single launch; the torch version's thirty-odd
   small kernels would cost more than the expert weights take to read. Larger (prefill) batches take three launches
   over chunks of rows (`align_in_parallel`); the torch version is the specification both are tested against.
   One token (batch-1 decode) needs none: its choices are distinct experts, so each row is a block of its own and
   the kernels read its expert straight from the ids. Prefill launches pad to a quarter of their tile
   (`MoeLaunch.align_m`) and the alignment also groups each expert's blocks into tiles (`Aligned.tiles`): the
   kernels compute an expert's last tile of one or two blocks as that many rows, not a whole tile's.
2. `_gate_up_kernel`: per block and BLOCK_N intermediate columns, the gate and up tiles of the block's expert are
   accumulated together over the hidden dimension and their product silu(gate) * up is stored, one row per choice.
   One token takes `_gate_up_one_token_kernel`, a GEMV over each choice's contiguous gate and up rows.
3. `_down_kernel`: the down projection of those rows, scaled by each row's routing weight before it is stored; then
   `_combine_kernel` sums the k rows of a token and a gated shared expert's output in float32, in one launch. One
   token takes `_down_one_token_kernel` instead, which makes that sum itself (no combine launch, no rounded rows);
   on Hopper its two launches go dependently, the down projection's weights read while the gate/up kernel runs.
Experts that receive no rows cost nothing; a token routed to one expert k times is k rows of that expert. Experts may
be bf16 or block-scaled e4m3 (FP8 checkpoints: one `weight_scale_inv` per 128 x 128 block of each projection); e4m3
tiles are dequantized in registers before the tensor-core product, so the weights are read at one byte each.
Under tensor parallelism each rank holds every expert's slice of the intermediate dimension (w13 `[E, 2I/tp, H]`,
w2 `[E, H, I/tp]`) and returns partial sums that the model all-reduces.

`moe_route` is the router after its projection in one launch (softmax, top k, renormalisation and the cast, five
torch kernels otherwise); given the shared expert's gate as the projection's last column, it also gives each token
the shared expert (the stack's last) as one more choice, weighted by the gate's sigmoid. With `fused_moe` a
decode step's MoE block is then the router's GEMM and four launches (two at batch 1, routed inside the first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .moe_reference import check_moe_shapes, check_route_shapes, check_shared_shapes
from .triton_utils import (INTERPRETED, cdiv, dependent_launch, hopper_or_later, next_power_of_2, release_dependents,
                           wait_for_producer)


@dataclass(frozen=True)
class MoeLaunch:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # One token's down projection (`_down_one_token_kernel`): output columns per program and warps (four columns
    # were fastest of 4-32 on an H100: 23.3 against 24.1 us for the layer at eight, 29.3 at 32; four warps beside
    # the GEMV below on the H200, bench/kernel_speed.py's --sweep).
    one_token_down_block_n: int = 4
    one_token_down_warps: int = 4
    # Weight tiles copied by the tensor memory accelerator where `tma_tiles_fit` says the stacks and GPU allow it
    # (pointer loads otherwise).
    tma: bool = False
    # One token's gate/up projection as a GEMV (`_gate_up_one_token_kernel`: each program walks the contiguous rows
    # of `one_token_gate_up_block_n` gate and as many up channels, `one_token_gate_up_block_k` inputs a tile), or,
    # with False, as the tensor-core tiles of more rows (block_m rows, one of them live).
    # The GEMV's defaults are the H200's fastest of 72 (two rows of 256 inputs a tile, two warps: 16.7 us for the
    # layer against 18.2 at four rows of 512 with four warps).
    one_token_gemv: bool = True
    one_token_gate_up_block_n: int = 2
    one_token_gate_up_block_k: int = 256
    one_token_gate_up_warps: int = 2
    # Rows each expert's run is padded to a multiple of (0: block_m). Smaller, block_m // align_m (2 or 4) aligned
    # blocks make a tile of block_m rows, and an expert's last tile of one block (or two of four) is computed as
    # that many rows: at 4,096 tokens of 8 choices among 256 experts (128 rows an expert on average), padding to 128
    # computes 1.50 rows for each routed one, to 32 in tiles of 32, 64 and 128 rows 1.13.
    align_m: int = 0
    # The down projection's tiles where they differ from the gate/up kernel's (0: the same). Its products have one
    # accumulator where the gate/up kernel has two (gate and up), so the same registers hold twice the columns.
    down_block_n: int = 0
    down_num_warps: int = 0
    down_num_stages: int = 0

    def __post_init__(self):
        if self.align_m and (self.block_m % self.align_m or self.block_m // self.align_m not in (1, 2, 4)):
            raise ValueError(f"align_m {self.align_m} must be block_m {self.block_m} over 1, 2 or 4")

    @property
    def down(self) -> tuple[int, int, int]:
        """(block_n, num_warps, num_stages) of the down projection's tiles."""
        return (self.down_block_n or self.block_n, self.down_num_warps or self.num_warps,
                self.down_num_stages or self.num_stages)

    @property
    def tile_blocks(self) -> int:
        """Aligned blocks a tile of block_m rows holds."""
        return self.block_m // self.align_m if self.align_m else 1


# Decode (few rows per expert) streams the weights: small row blocks, many column blocks to fill the GPU; with at
# most `FEW_ROWS` rows (8 tokens of 8 choices) there are only that many row blocks, so the column blocks narrow.
# Prefill packs rows into large tiles for the tensor cores. Each is the fastest of bench/kernel_speed.py's --sweep on
# the H200 at Qwen3.5-35B-A3B's geometry (1, 16 and 4,096 tokens); the prefill tiles come through the tensor memory
# accelerator (on an H100 at 4,096 tokens: 868 against 884 us, and faster with it in every tile shape swept), and an
# expert's last rows take a tile of 32 or 64 rows where they fit one (826.9 against 842.8 us on an H100 in one sweep;
# its gate/up kernel 490 against 511 us with the L2 at 89 and 86 % of its throughput, Nsight Compute).
FEW_ROWS_LAUNCH = MoeLaunch(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
FEW_ROWS = 64
DECODE_LAUNCH = MoeLaunch(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
PREFILL_LAUNCH = MoeLaunch(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, tma=True, align_m=32)
# Rows per expert (on average) past which prefill tiles pay off.
PREFILL_ROWS_PER_EXPERT = 32


def launch_for(num_rows: int, num_experts: int) -> MoeLaunch:
    if num_rows >= PREFILL_ROWS_PER_EXPERT * num_experts:
        return PREFILL_LAUNCH
    return FEW_ROWS_LAUNCH if num_rows <= FEW_ROWS else DECODE_LAUNCH


def tma_tiles_fit(w13: torch.Tensor, w2: torch.Tensor, launch: MoeLaunch) -> bool:
    """Whether both stacks can be read through tensor descriptors in the launch's tiles: a GPU with the tensor
    memory accelerator (Hopper and later; the interpreter emulates it), contiguous stacks at 16-byte aligned
    addresses with rows a multiple of 16 bytes, and K tiles of at most 128 bytes (one swizzled shared-memory row)."""
    for stack in (w13, w2):
        row_bytes = stack.shape[-1] * stack.element_size()
        if not stack.is_contiguous() or row_bytes % 16 or stack.data_ptr() % 16:
            return False
        if launch.block_k * stack.element_size() > 128:
            return False
    return INTERPRETED or (w13.is_cuda and hopper_or_later(w13.device.index))


def alignment_for(num_tokens: int, num_rows: int, launch: MoeLaunch) -> str:
    """How `fused_moe` sorts `num_rows` rows of `num_tokens` tokens by expert for `launch`: "none" (one token:
    each row is a block of its own), "one_launch" (`align_in_one_launch`, decode-sized, tiles of one block) or
    "parallel" (`align_in_parallel`)."""
    if num_tokens == 1:
        return "none"
    return "one_launch" if num_rows <= ONE_LAUNCH_ALIGN_ROWS and launch.tile_blocks == 1 else "parallel"


class Aligned(NamedTuple):
    """The (token, choice) rows of a batch sorted by expert (what `align_by_expert` and its Triton versions return).

    sorted_rows `[num_blocks * block_m]` int32: row indices (t * k + j) grouped by expert, each expert's run padded
    to a multiple of `block_m` with the sentinel T*k; block_experts `[num_blocks]` int32: the expert of each block;
    num_padded `[1]` int32: how many sorted rows are in use (a device tensor, never read on the host). With
    `tile_blocks` > 1, tiles `[2, num_tiles]` int32 groups each expert's blocks into tiles of up to `tile_blocks`
    blocks, its last tile holding what is left: row 0 each tile's first block, row 1 its blocks (0 past the last
    tile); None with tile_blocks 1, where a tile is a block (and num_tiles is num_blocks).
    """

    sorted_rows: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    num_blocks: int
    tiles: torch.Tensor | None
    num_tiles: int


def aligned_sizes(num_rows: int, num_experts: int, block_m: int, tile_blocks: int = 1) -> tuple[int, int]:
    """(blocks, tiles) the buffers hold for `num_rows` rows whatever their route: each expert that gets rows pads
    its run by less than a block (and its tiles by less than a tile)."""
    live_experts = min(num_experts, num_rows)
    tile_m = block_m * tile_blocks
    return (cdiv(num_rows + live_experts * (block_m - 1), block_m),
            cdiv(num_rows + live_experts * (tile_m - 1), tile_m))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, tile_blocks: int = 1) -> Aligned:
    """The specification of the alignment (torch ops): the `Aligned` buffers for the T*k rows of `topk_ids`
    `[T, k]`, tiles of up to `tile_blocks` blocks of `block_m` rows."""
    flat_ids = topk_ids.reshape(-1).long()
    num_rows = flat_ids.numel()
    device = flat_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat_ids,
                                                                                      torch.ones_like(flat_ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat_ids, stable=True)
    sorted_experts = flat_ids[order]
    rank_in_expert = torch.arange(num_rows, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    num_blocks, num_tiles = aligned_sizes(num_rows, num_experts, block_m, tile_blocks)
    sorted_rows = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[(padded_end - padded)[sorted_experts] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    aligned = Aligned(sorted_rows, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32), num_blocks, None,
                      num_blocks)
    if tile_blocks == 1:
        return aligned
    blocks = padded // block_m
    expert_tiles = (blocks + tile_blocks - 1) // tile_blocks
    tile_end = expert_tiles.cumsum(0)
    tile = torch.arange(num_tiles, device=device)
    expert = torch.searchsorted(tile_end, tile, right=True).clamp_(max=num_experts - 1)
    nth = tile - (tile_end - expert_tiles)[expert]  # the tile's place among its expert's
    first = (padded_end - padded)[expert] // block_m + nth * tile_blocks
    in_tile = (blocks[expert] - nth * tile_blocks).clamp(max=tile_blocks)
    live = tile < tile_end[-1]
    tiles = torch.stack([torch.where(live, first, 0), torch.where(live, in_tile, 0)]).to(torch.int32)
    return aligned._replace(tiles=tiles, num_tiles=num_tiles)


# Rows (tokens x choices) up to which one program aligns them (`_align_kernel`); it walks them in chunks, one after
# another, so past a few hundred rows a program per chunk is faster (the threshold was measured against the torch
# version's kernels).
ONE_LAUNCH_ALIGN_ROWS = 256
# Elements of one chunk's [rows, experts] comparison, spread over the program's threads.
_ALIGN_CHUNK_ELEMENTS = 8192


@triton.jit
def _chunk_hits(ids_ptr, start, num_rows, experts, CHUNK: tl.constexpr):
    """(rows `[CHUNK]` from `start`, their one-hot experts `[CHUNK, EXPERTS]`; rows past `num_rows` hit none)."""
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_rows, other=-1).to(tl.int32)
    return offs, (ids[:, None] == experts[None, :]).to(tl.int32)


@triton.jit
def _place_chunk(sorted_rows_ptr, offs, hits, next_position, num_rows):
    """Each row of a chunk written after the earlier rows of its expert (`next_position`: where each expert's next
    row goes); -> the positions after the chunk."""
    earlier = tl.cumsum(hits, axis=0) - hits  # rows of the same expert before this one in the chunk
    position = tl.sum(hits * (next_position[None, :] + earlier), axis=1)
    tl.store(sorted_rows_ptr + position, offs, mask=offs < num_rows)
    return next_position + tl.sum(hits, axis=0)


@triton.jit
def _name_block_experts(block_experts_ptr, blocks, live, padded_end, expert_live, NUM_EXPERTS: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    """The expert whose padded run holds each block's first row: how many runs end at or before it."""
    ended = (padded_end[None, :] <= (blocks * BLOCK_M)[:, None]) & expert_live[None, :]
    tl.store(block_experts_ptr + blocks, tl.minimum(tl.sum(ended.to(tl.int32), axis=1), NUM_EXPERTS - 1), mask=live)


@triton.jit(do_not_specialize=["num_rows", "num_blocks"])
def _align_kernel(ids_ptr, sorted_rows_ptr, block_experts_ptr, num_padded_ptr, num_rows, num_blocks,
                  NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """`align_by_expert` in one program: count rows per expert, pad and prefix-sum the counts, fill the sentinel,
    then place each row after the earlier rows of its expert (a stable sort) and name each block's expert."""
    experts = tl.arange(0, EXPERTS)
    expert_live = experts < NUM_EXPERTS
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for start in range(0, num_rows, CHUNK):
        _, hits = _chunk_hits(ids_ptr, start, num_rows, experts, CHUNK)
        counts += tl.sum(hits, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    for start in range(0, num_blocks * BLOCK_M, CHUNK * 4):
        offs = start + tl.arange(0, CHUNK * 4)
        tl.store(sorted_rows_ptr + offs, tl.zeros([CHUNK * 4], dtype=tl.int32) + num_rows,
                 mask=offs < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the sentinel is in place before any row overwrites it
    next_position = padded_end - padded  # per expert: where its next row goes
    for start in range(0, num_rows, CHUNK):
        offs, hits = _chunk_hits(ids_ptr, start, num_rows, experts, CHUNK)
        next_position = _place_chunk(sorted_rows_ptr, offs, hits, next_position, num_rows)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        _name_block_experts(block_experts_ptr, blocks, blocks < num_blocks, padded_end, expert_live, NUM_EXPERTS,
                            BLOCK_M)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))


# Rows a program of the parallel alignment counts and places (its grid is the rows over this, at run time); it walks
# them `_ALIGN_CHUNK_ELEMENTS // experts` at a time. 256: 128 programs at 4,096 tokens of 8 choices.
PARALLEL_ALIGN_ROWS = 256


@triton.jit(do_not_specialize=["num_rows", "fill_stride", "sorted_slots"])
def _count_rows_kernel(ids_ptr, chunk_counts_ptr, sorted_rows_ptr, num_rows, fill_stride, sorted_slots,
                       EXPERTS: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """The parallel alignment's first pass: program c counts the rows of its ROWS per expert (chunk_counts row c,
    EXPERTS wide) and fills its stripe of the sorted rows with the sentinel (`num_rows`)."""
    program = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for start in range(program * ROWS, program * ROWS + ROWS, CHUNK):
        _, hits = _chunk_hits(ids_ptr, start, num_rows, experts, CHUNK)
        counts += tl.sum(hits, axis=0)
    tl.store(chunk_counts_ptr + program * EXPERTS + experts, counts)
    for start in range(program * fill_stride, program * fill_stride + fill_stride, CHUNK * 4):
        offs = start + tl.arange(0, CHUNK * 4)
        live = (offs < program * fill_stride + fill_stride) & (offs < sorted_slots)
        tl.store(sorted_rows_ptr + offs, tl.zeros([CHUNK * 4], dtype=tl.int32) + num_rows, mask=live)


@triton.jit(do_not_specialize=["num_chunks"])
def _place_chunks_kernel(chunk_counts_ptr, chunk_starts_ptr, expert_ends_ptr, tile_ends_ptr, num_padded_ptr,
                         num_chunks, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr,
                         TILE_BLOCKS: tl.constexpr):
    """The second pass, one program: each expert's padded run (the counts summed over chunks; expert_ends, where
    each run ends), where each chunk's rows of each expert begin in it (chunk_starts, chunk order: a stable sort),
    and the padded length; with TILE_BLOCKS > 1, where each expert's tiles end (tile_ends)."""
    experts = tl.arange(0, EXPERTS)
    totals = tl.zeros([EXPERTS], dtype=tl.int32)
    for first in range(0, num_chunks, CHUNKS):
        chunks = first + tl.arange(0, CHUNKS)
        tile = tl.load(chunk_counts_ptr + chunks[:, None] * EXPERTS + experts[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(expert_ends_ptr + experts, padded_end)
    if TILE_BLOCKS > 1:
        tl.store(tile_ends_ptr + experts, tl.cumsum((padded // BLOCK_M + TILE_BLOCKS - 1) // TILE_BLOCKS, axis=0))
    running = padded_end - padded
    for first in range(0, num_chunks, CHUNKS):
        chunks = first + tl.arange(0, CHUNKS)
        live = (chunks < num_chunks)[:, None]
        tile = tl.load(chunk_counts_ptr + chunks[:, None] * EXPERTS + experts[None, :], mask=live, other=0)
        tl.store(chunk_starts_ptr + chunks[:, None] * EXPERTS + experts[None, :],
                 running[None, :] + tl.cumsum(tile, axis=0) - tile, mask=live)
        running += tl.sum(tile, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))


@triton.jit
def _name_tiles(tiles_ptr, tiles, live, num_tiles, expert_ends_ptr, tile_ends_ptr, tile_ends, expert_live,
                NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Each tile's first block and its blocks (`Aligned.tiles`): its expert is how many experts' tiles end at or
    before it; it is that expert's nth, and holds up to TILE_BLOCKS of the expert's blocks from the nth group on.
    Tiles past the last one get 0 blocks."""
    expert = tl.minimum(tl.sum(((tile_ends[None, :] <= tiles[:, None]) & expert_live[None, :]).to(tl.int32), axis=1),
                        NUM_EXPERTS - 1)
    run_end = tl.load(expert_ends_ptr + expert, mask=live, other=0)
    run_start = tl.load(expert_ends_ptr + expert - 1, mask=live & (expert > 0), other=0)
    expert_blocks = (run_end - run_start) // BLOCK_M
    expert_tiles = (expert_blocks + TILE_BLOCKS - 1) // TILE_BLOCKS
    nth = tiles - (tl.load(tile_ends_ptr + expert, mask=live, other=0) - expert_tiles)
    in_use = tiles < tl.max(tile_ends, axis=0)
    first = tl.where(in_use, run_start // BLOCK_M + nth * TILE_BLOCKS, 0)
    blocks = tl.where(in_use, tl.minimum(expert_blocks - nth * TILE_BLOCKS, TILE_BLOCKS), 0)
    tl.store(tiles_ptr + tiles, first, mask=live)
    tl.store(tiles_ptr + num_tiles + tiles, blocks, mask=live)


@triton.jit(do_not_specialize=["num_rows", "num_blocks", "block_stride", "num_tiles", "tile_stride"])
def _place_rows_kernel(ids_ptr, chunk_starts_ptr, expert_ends_ptr, tile_ends_ptr, sorted_rows_ptr, block_experts_ptr,
                       tiles_ptr, num_rows, num_blocks, block_stride, num_tiles, tile_stride,
                       NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                       CHUNK: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """The third pass: program c writes each of its rows after the earlier rows of its expert, and names the expert
    of each block in its stripe of `block_stride` blocks (the expert whose padded run holds the block's first row:
    how many runs end at or before it); with TILE_BLOCKS > 1, it names its stripe of `tile_stride` tiles too."""
    program = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    next_position = tl.load(chunk_starts_ptr + program * EXPERTS + experts)
    for start in range(program * ROWS, program * ROWS + ROWS, CHUNK):
        offs, hits = _chunk_hits(ids_ptr, start, num_rows, experts, CHUNK)
        next_position = _place_chunk(sorted_rows_ptr, offs, hits, next_position, num_rows)
    expert_ends = tl.load(expert_ends_ptr + experts)
    last_block = tl.minimum(program * block_stride + block_stride, num_blocks)
    for first in range(program * block_stride, last_block, CHUNK):
        blocks = first + tl.arange(0, CHUNK)
        _name_block_experts(block_experts_ptr, blocks, blocks < last_block, expert_ends, experts < NUM_EXPERTS,
                            NUM_EXPERTS, BLOCK_M)
    if TILE_BLOCKS > 1:
        tile_ends = tl.load(tile_ends_ptr + experts)
        last_tile = tl.minimum(program * tile_stride + tile_stride, num_tiles)
        for first in range(program * tile_stride, last_tile, CHUNK):
            tiles = first + tl.arange(0, CHUNK)
            _name_tiles(tiles_ptr, tiles, tiles < last_tile, num_tiles, expert_ends_ptr, tile_ends_ptr, tile_ends,
                        experts < NUM_EXPERTS, NUM_EXPERTS, BLOCK_M, TILE_BLOCKS)


def align_in_parallel(topk_ids: torch.Tensor, num_experts: int, block_m: int, tile_blocks: int = 1) -> Aligned:
    """What `align_by_expert` returns, in three launches over `PARALLEL_ALIGN_ROWS`-row chunks (prefill-sized
    batches): per-chunk counts (and the sentinel fill), one program's prefix sums over experts and chunks, then
    each chunk's rows placed and a stripe of the blocks' experts (and of the tiles) named."""
    flat_ids = topk_ids.reshape(-1)
    flat_ids = flat_ids if flat_ids.is_contiguous() else flat_ids.contiguous()
    num_rows = flat_ids.numel()
    num_blocks, num_tiles = aligned_sizes(num_rows, num_experts, block_m, tile_blocks)
    device = flat_ids.device
    experts = next_power_of_2(num_experts)
    chunk = min(PARALLEL_ALIGN_ROWS, max(16, _ALIGN_CHUNK_ELEMENTS // experts))  # divides a program's rows
    num_chunks = cdiv(num_rows, PARALLEL_ALIGN_ROWS)
    sorted_rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    chunk_counts = torch.empty(num_chunks, experts, dtype=torch.int32, device=device)
    chunk_starts = torch.empty_like(chunk_counts)
    expert_ends = torch.empty(experts, dtype=torch.int32, device=device)
    tiled = tile_blocks > 1
    # Without tiles, the tile buffers are never written: the padded runs' ends stand in for them.
    tile_ends = torch.empty(experts, dtype=torch.int32, device=device) if tiled else expert_ends
    tiles = torch.empty(2, num_tiles, dtype=torch.int32, device=device) if tiled else expert_ends
    _count_rows_kernel[(num_chunks,)](flat_ids, chunk_counts, sorted_rows, num_rows,
                                      cdiv(sorted_rows.numel(), num_chunks), sorted_rows.numel(), EXPERTS=experts,
                                      ROWS=PARALLEL_ALIGN_ROWS, CHUNK=chunk, num_warps=4)
    _place_chunks_kernel[(1,)](chunk_counts, chunk_starts, expert_ends, tile_ends, num_padded, num_chunks,
                               EXPERTS=experts, BLOCK_M=block_m, CHUNKS=max(2, _ALIGN_CHUNK_ELEMENTS // experts),
                               TILE_BLOCKS=tile_blocks, num_warps=8)
    _place_rows_kernel[(num_chunks,)](flat_ids, chunk_starts, expert_ends, tile_ends, sorted_rows, block_experts,
                                      tiles, num_rows, num_blocks, cdiv(num_blocks, num_chunks), num_tiles,
                                      cdiv(num_tiles, num_chunks), NUM_EXPERTS=num_experts, EXPERTS=experts,
                                      BLOCK_M=block_m, ROWS=PARALLEL_ALIGN_ROWS, CHUNK=chunk,
                                      TILE_BLOCKS=tile_blocks, num_warps=4)
    # With tiles of one block, aligned_sizes' tiles are the blocks.
    return Aligned(sorted_rows, block_experts, num_padded, num_blocks, tiles if tiled else None, num_tiles)


def align_in_one_launch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """What `align_by_expert` returns (tiles of one block), from `_align_kernel` (decode-sized batches)."""
    flat_ids = topk_ids.reshape(-1)
    flat_ids = flat_ids if flat_ids.is_contiguous() else flat_ids.contiguous()
    num_rows = flat_ids.numel()
    num_blocks, _ = aligned_sizes(num_rows, num_experts, block_m)
    device = flat_ids.device
    sorted_rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    experts = next_power_of_2(num_experts)
    _align_kernel[(1,)](flat_ids, sorted_rows, block_experts, num_padded, num_rows, num_blocks,
                        NUM_EXPERTS=num_experts, EXPERTS=experts, BLOCK_M=block_m,
                        CHUNK=max(16, _ALIGN_CHUNK_ELEMENTS // experts), num_warps=8)
    return Aligned(sorted_rows, block_experts, num_padded, num_blocks, None, num_blocks)


@triton.jit
def _scaled(tile, scale_ptr, scale_rows, k_start, mask, SCALE_BLOCK: tl.constexpr, dtype: tl.constexpr):
    """An e4m3 weight tile `[BLOCK_K, BLOCK_N]` times its blocks' `weight_scale_inv`, in `dtype`: `scale_ptr` points
    at the expert's scale grid, `scale_rows` `[BLOCK_N]` is each column's row of it, and the K tile lies inside one
    block column (SCALE_BLOCK a multiple of BLOCK_K)."""
    scales = tl.load(scale_ptr + scale_rows + k_start // SCALE_BLOCK, mask=mask, other=0.0).to(tl.float32)
    return (tile.to(tl.float32) * scales[None, :]).to(dtype)


@triton.jit
def _block_rows(block, sorted_rows_ptr, block_experts_ptr, num_padded_ptr, num_rows, BLOCK_M: tl.constexpr,
                ONE_ROW_BLOCKS: tl.constexpr):
    """(expert, rows `[BLOCK_M]`) of one block of rows; expert -1 for a block past the padded rows. With
    ONE_ROW_BLOCKS (one token: its choices are distinct experts) block b is row b alone, its expert read from the
    ids themselves (`block_experts_ptr` is `topk_ids`), so no alignment ran; otherwise the aligned buffers say."""
    if ONE_ROW_BLOCKS:
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, block, num_rows)
        expert = tl.where(block < num_rows, tl.load(block_experts_ptr + block, mask=block < num_rows, other=-1), -1)
    else:
        rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        live = block * BLOCK_M < tl.load(num_padded_ptr)
        expert = tl.where(live, tl.load(block_experts_ptr + block, mask=live, other=-1), -1)
    return expert.to(tl.int64), rows


@triton.jit
def _tile_rows(tiles_ptr, tile, blocks, sorted_rows_ptr, block_experts_ptr, num_rows, TILE_M: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """(expert, rows `[TILE_M]`) of one tile of `Aligned.tiles` holding `blocks` blocks: their sorted rows, the
    sentinel past them."""
    first = tl.load(tiles_ptr + tile)
    offs = tl.arange(0, TILE_M)
    rows = tl.load(sorted_rows_ptr + first * BLOCK_M + offs, mask=offs < blocks * BLOCK_M, other=num_rows)
    return tl.load(block_experts_ptr + first).to(tl.int64), rows


@triton.jit
def _gate_up_rows(
    x_ptr, w13_ptr, out_ptr, expert, rows, n_block, num_rows, top_k, hidden_size, intermediate_size, stride_x_row,
    stride_w_expert, stride_w_row, stride_out_row, s13_ptr, stride_s_expert, stride_s_row, up_scale_row0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALE_BLOCK: tl.constexpr, TMA: tl.constexpr,
):
    """silu(gate) * up of BLOCK_M rows (`rows`, the sentinel `num_rows` for none) of one expert, BLOCK_N columns
    from n_block's, stored one row per choice."""
    # With TMA, w13_ptr is a tensor descriptor of the stack as [E * 2I, H] in [BLOCK_N, BLOCK_K] tiles: rows past an
    # expert's gate (or up) rows read its neighbours' only into columns the store masks, K past H reads zeros.
    row_live = rows < num_rows
    tokens = (rows // top_k).to(tl.int64)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = offs_n < intermediate_size
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x_row + offs_k[None, :]
    if TMA:
        gate_row = (expert * 2 * intermediate_size + n_block * BLOCK_N).to(tl.int32)
        up_row = gate_row + intermediate_size
    else:
        gate_ptrs = (w13_ptr + expert * stride_w_expert + offs_n[None, :].to(tl.int64) * stride_w_row
                     + offs_k[:, None])
        up_ptrs = gate_ptrs + intermediate_size * stride_w_row
    if SCALE_BLOCK:  # e4m3 experts: each column's scale rows, gate blocks then up blocks
        scale_ptr = s13_ptr + expert * stride_s_expert
        gate_scale_rows = (offs_n // SCALE_BLOCK).to(tl.int64) * stride_s_row
        up_scale_rows = (up_scale_row0 + offs_n // SCALE_BLOCK).to(tl.int64) * stride_s_row
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, hidden_size, BLOCK_K):
        k_live = offs_k < hidden_size - k_start
        x_tile = tl.load(x_ptrs, mask=row_live[:, None] & k_live[None, :], other=0.0)
        if TMA:
            gate_tile = w13_ptr.load([gate_row, k_start]).T
            up_tile = w13_ptr.load([up_row, k_start]).T
        else:
            gate_tile = tl.load(gate_ptrs, mask=k_live[:, None] & col_live[None, :], other=0.0)
            up_tile = tl.load(up_ptrs, mask=k_live[:, None] & col_live[None, :], other=0.0)
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        if SCALE_BLOCK:
            gate_tile = _scaled(gate_tile, scale_ptr, gate_scale_rows, k_start, col_live, SCALE_BLOCK,
                                x_ptr.dtype.element_ty)
            up_tile = _scaled(up_tile, scale_ptr, up_scale_rows, k_start, col_live, SCALE_BLOCK,
                              x_ptr.dtype.element_ty)
        if FLOAT32_DOT:
            x_tile, gate_tile, up_tile = x_tile.to(tl.float32), gate_tile.to(tl.float32), up_tile.to(tl.float32)
        gate = tl.dot(x_tile, gate_tile, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x_tile, up_tile, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
    product = gate * tl.sigmoid(gate) * up
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out_ptrs, product.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & col_live[None, :])


@triton.jit
def _gate_up_tile(
    x_ptr, w13_ptr, out_ptr, tile, blocks, tiles_ptr, sorted_rows_ptr, block_experts_ptr, n_block, num_rows, top_k,
    hidden_size, intermediate_size, stride_x_row, stride_w_expert, stride_w_row, stride_out_row, s13_ptr,
    stride_s_expert, stride_s_row, up_scale_row0, TILE_M: tl.constexpr, ALIGN_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    TMA: tl.constexpr,
):
    """`_gate_up_rows` of one tile of `Aligned.tiles`, TILE_M rows."""
    expert, rows = _tile_rows(tiles_ptr, tile, blocks, sorted_rows_ptr, block_experts_ptr, num_rows, TILE_M,
                              ALIGN_M)
    _gate_up_rows(x_ptr, w13_ptr, out_ptr, expert, rows, n_block, num_rows, top_k, hidden_size, intermediate_size,
                  stride_x_row, stride_w_expert, stride_w_row, stride_out_row, s13_ptr, stride_s_expert, stride_s_row,
                  up_scale_row0, TILE_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION, SCALE_BLOCK, TMA)


@triton.jit(do_not_specialize=["num_rows", "num_routed_experts", "num_tiles"])
def _gate_up_kernel(
    x_ptr, w13_ptr, out_ptr, sorted_rows_ptr, block_experts_ptr, num_padded_ptr, tiles_ptr, num_tiles, num_rows,
    top_k, hidden_size, intermediate_size, stride_x_row, stride_w_expert, stride_w_row, stride_out_row, s13_ptr,
    stride_s_expert, stride_s_row, up_scale_row0, logits_ptr, num_routed_experts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALE_BLOCK: tl.constexpr, ONE_ROW_BLOCKS: tl.constexpr,
    ROUTE: tl.constexpr, ROUTE_TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP_K: tl.constexpr,
    RENORMALISE: tl.constexpr, SHARED: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
):
    # Program p computes n-block p % (I / BLOCK_N) of tile p // (I / BLOCK_N). With TILE_BLOCKS > 1 the tiles are
    # `Aligned.tiles` of up to TILE_BLOCKS aligned blocks (BLOCK_M rows whole): an expert's last tile of one or two
    # blocks is computed as that many rows, not BLOCK_M. Otherwise a tile is an aligned block of BLOCK_M rows.
    # Launched dependently (one token), it waits for the router before anything, since which weights it reads
    # depends on the route, then lets the down projection start and load its own weights beside this kernel.
    wait_for_producer(PDL)
    release_dependents(PDL)
    num_n_blocks = tl.cdiv(intermediate_size, BLOCK_N)
    tile = tl.program_id(0) // num_n_blocks
    n_block = tl.program_id(0) % num_n_blocks
    ALIGN_M: tl.constexpr = BLOCK_M // TILE_BLOCKS
    if TILE_BLOCKS == 1:
        if ROUTE:  # one token (ONE_ROW_BLOCKS): every program routes it; block b runs its b-th choice
            expert = _routed_expert(tile, logits_ptr, num_routed_experts, ROUTE_TOP_K, BLOCK_E, BLOCK_TOP_K,
                                    RENORMALISE, SHARED)
            rows = tl.where(tl.arange(0, BLOCK_M) == 0, tile, num_rows)
        else:
            expert, rows = _block_rows(tile, sorted_rows_ptr, block_experts_ptr, num_padded_ptr, num_rows, BLOCK_M,
                                       ONE_ROW_BLOCKS)
            if expert < 0:
                return
        _gate_up_rows(x_ptr, w13_ptr, out_ptr, expert, rows, n_block, num_rows, top_k, hidden_size,
                      intermediate_size, stride_x_row, stride_w_expert, stride_w_row, stride_out_row, s13_ptr,
                      stride_s_expert, stride_s_row, up_scale_row0, BLOCK_M, BLOCK_N, BLOCK_K, FLOAT32_DOT,
                      DOT_PRECISION, SCALE_BLOCK, TMA)
    else:
        blocks = tl.load(tiles_ptr + num_tiles + tile)
        if blocks == 0:
            return
        # An expert's last tile of one block, or of two (of four), is computed as that many rows.
        if blocks == 1:
            _gate_up_tile(x_ptr, w13_ptr, out_ptr, tile, blocks, tiles_ptr, sorted_rows_ptr, block_experts_ptr,
                          n_block, num_rows, top_k, hidden_size, intermediate_size, stride_x_row, stride_w_expert,
                          stride_w_row, stride_out_row, s13_ptr, stride_s_expert, stride_s_row, up_scale_row0,
                          ALIGN_M, ALIGN_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION, SCALE_BLOCK, TMA)
        elif blocks * 2 <= TILE_BLOCKS:
            _gate_up_tile(x_ptr, w13_ptr, out_ptr, tile, blocks, tiles_ptr, sorted_rows_ptr, block_experts_ptr,
                          n_block, num_rows, top_k, hidden_size, intermediate_size, stride_x_row, stride_w_expert,
                          stride_w_row, stride_out_row, s13_ptr, stride_s_expert, stride_s_row, up_scale_row0,
                          BLOCK_M // 2, ALIGN_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION, SCALE_BLOCK, TMA)
        else:
            _gate_up_tile(x_ptr, w13_ptr, out_ptr, tile, blocks, tiles_ptr, sorted_rows_ptr, block_experts_ptr,
                          n_block, num_rows, top_k, hidden_size, intermediate_size, stride_x_row, stride_w_expert,
                          stride_w_row, stride_out_row, s13_ptr, stride_s_expert, stride_s_row, up_scale_row0,
                          BLOCK_M, ALIGN_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION, SCALE_BLOCK, TMA)


@triton.jit
def _gate_up_one_token_kernel(
    x_ptr, w13_ptr, out_ptr, ids_ptr, hidden_size, stride_w_expert, stride_w_row, s13_ptr, stride_s_expert,
    stride_s_row, up_scale_row0, logits_ptr, num_routed_experts,
    INTERMEDIATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ROUTE: tl.constexpr, ROUTE_TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP_K: tl.constexpr,
    RENORMALISE: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
):
    """One token's silu(gate) * up for BLOCK_N intermediate channels of one choice, as a GEMV: the program walks
    those channels' gate rows and up rows (contiguous along the hidden dimension) a K tile at a time, one tile ahead,
    multiplying in float32, and stores the product in the choice's row of `out_ptr`. With ROUTE the program routes
    the token from the router's logits (the shared expert, with SHARED, as the last choice). With SCALE_BLOCK the
    e4m3 rows are scaled per block (BLOCK_K inside one block)."""
    wait_for_producer(PDL)  # which rows to read depends on the route: nothing can be loaded before it
    release_dependents(PDL)
    num_n_blocks = (INTERMEDIATE + BLOCK_N - 1) // BLOCK_N
    choice = tl.program_id(0) // num_n_blocks
    n_block = tl.program_id(0) % num_n_blocks
    if ROUTE:
        expert = _routed_expert(choice, logits_ptr, num_routed_experts, ROUTE_TOP_K, BLOCK_E, BLOCK_TOP_K,
                                RENORMALISE, SHARED)
    else:
        expert = tl.load(ids_ptr + choice).to(tl.int64)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = offs_n < INTERMEDIATE
    gate_rows = w13_ptr + expert * stride_w_expert + offs_n.to(tl.int64)[:, None] * stride_w_row
    up_rows = gate_rows + INTERMEDIATE * stride_w_row
    if SCALE_BLOCK:
        gate_scales = s13_ptr + expert * stride_s_expert + (offs_n // SCALE_BLOCK).to(tl.int64) * stride_s_row
        up_scales = (s13_ptr + expert * stride_s_expert
                     + (up_scale_row0 + offs_n // SCALE_BLOCK).to(tl.int64) * stride_s_row)
    offs_k = tl.arange(0, BLOCK_K)
    live = col_live[:, None] & (offs_k < hidden_size)[None, :]
    gate_ahead = tl.load(gate_rows + offs_k[None, :], mask=live, other=0.0)
    up_ahead = tl.load(up_rows + offs_k[None, :], mask=live, other=0.0)
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_start in range(0, hidden_size, BLOCK_K):
        gate_tile, up_tile = gate_ahead, up_ahead
        x = tl.load(x_ptr + k_start + offs_k, mask=offs_k < hidden_size - k_start, other=0.0).to(tl.float32)
        ahead = k_start + BLOCK_K + offs_k
        live = col_live[:, None] & (ahead < hidden_size)[None, :]
        gate_ahead = tl.load(gate_rows + ahead[None, :], mask=live, other=0.0)
        up_ahead = tl.load(up_rows + ahead[None, :], mask=live, other=0.0)
        if SCALE_BLOCK:  # the tile's blocks' scales, rounded through the input dtype as the tile kernel does
            dtype = x_ptr.dtype.element_ty
            gate_scale = tl.load(gate_scales + k_start // SCALE_BLOCK, mask=col_live, other=0.0).to(tl.float32)
            up_scale = tl.load(up_scales + k_start // SCALE_BLOCK, mask=col_live, other=0.0).to(tl.float32)
            gate_tile = (gate_tile.to(tl.float32) * gate_scale[:, None]).to(dtype)
            up_tile = (up_tile.to(tl.float32) * up_scale[:, None]).to(dtype)
        gate += gate_tile.to(tl.float32) * x[None, :]
        up += up_tile.to(tl.float32) * x[None, :]
    gate_sum = tl.sum(gate, axis=1)
    product = gate_sum * tl.sigmoid(gate_sum) * tl.sum(up, axis=1)
    tl.store(out_ptr + choice * INTERMEDIATE + offs_n, product.to(out_ptr.dtype.element_ty), mask=col_live)


@triton.jit
def _down_rows(
    product_ptr, w2_ptr, out_ptr, weights_ptr, expert, rows, n_block, num_rows, hidden_size, intermediate_size,
    stride_p_row, stride_w_expert, stride_w_row, stride_out_row, s2_ptr, stride_s_expert, stride_s_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALE_BLOCK: tl.constexpr, TMA: tl.constexpr,
):
    """The down projection of BLOCK_M rows (`rows`, the sentinel `num_rows` for none) of one expert, BLOCK_N output
    columns from n_block's, each row scaled by its routing weight."""
    # With TMA, w2_ptr is a tensor descriptor of the stack as [E * H, I] in [BLOCK_N, BLOCK_K] tiles (as above).
    row_live = rows < num_rows
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = offs_n < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    p_ptrs = product_ptr + rows.to(tl.int64)[:, None] * stride_p_row + offs_k[None, :]
    if TMA:
        w_row = (expert * hidden_size + n_block * BLOCK_N).to(tl.int32)
    else:
        w_ptrs = w2_ptr + expert * stride_w_expert + offs_n[None, :].to(tl.int64) * stride_w_row + offs_k[:, None]
    if SCALE_BLOCK:
        scale_ptr = s2_ptr + expert * stride_s_expert
        scale_rows = (offs_n // SCALE_BLOCK).to(tl.int64) * stride_s_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, intermediate_size, BLOCK_K):
        k_live = offs_k < intermediate_size - k_start
        p_tile = tl.load(p_ptrs, mask=row_live[:, None] & k_live[None, :], other=0.0)
        if TMA:
            w_tile = w2_ptr.load([w_row, k_start]).T
        else:
            w_tile = tl.load(w_ptrs, mask=k_live[:, None] & col_live[None, :], other=0.0)
            w_ptrs += BLOCK_K
        if SCALE_BLOCK:
            w_tile = _scaled(w_tile, scale_ptr, scale_rows, k_start, col_live, SCALE_BLOCK,
                             product_ptr.dtype.element_ty)
        if FLOAT32_DOT:
            p_tile, w_tile = p_tile.to(tl.float32), w_tile.to(tl.float32)
        acc = tl.dot(p_tile, w_tile, acc, input_precision=DOT_PRECISION)
        p_ptrs += BLOCK_K
    routing_weight = tl.load(weights_ptr + rows, mask=row_live, other=0.0).to(tl.float32)
    acc = acc * routing_weight[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & col_live[None, :])


@triton.jit
def _down_tile(
    product_ptr, w2_ptr, out_ptr, weights_ptr, tile, blocks, tiles_ptr, sorted_rows_ptr, block_experts_ptr,
    n_block, num_rows, hidden_size, intermediate_size, stride_p_row, stride_w_expert, stride_w_row, stride_out_row,
    s2_ptr, stride_s_expert, stride_s_row, TILE_M: tl.constexpr, ALIGN_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    TMA: tl.constexpr,
):
    """`_down_rows` of one tile of `Aligned.tiles`, TILE_M rows."""
    expert, rows = _tile_rows(tiles_ptr, tile, blocks, sorted_rows_ptr, block_experts_ptr, num_rows, TILE_M,
                              ALIGN_M)
    _down_rows(product_ptr, w2_ptr, out_ptr, weights_ptr, expert, rows, n_block, num_rows, hidden_size,
               intermediate_size, stride_p_row, stride_w_expert, stride_w_row, stride_out_row, s2_ptr,
               stride_s_expert, stride_s_row, TILE_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION, SCALE_BLOCK, TMA)


@triton.jit(do_not_specialize=["num_rows", "num_tiles"])
def _down_kernel(
    product_ptr, w2_ptr, out_ptr, weights_ptr, sorted_rows_ptr, block_experts_ptr, num_padded_ptr, tiles_ptr,
    num_tiles, num_rows, hidden_size, intermediate_size, stride_p_row, stride_w_expert, stride_w_row, stride_out_row,
    s2_ptr, stride_s_expert, stride_s_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALE_BLOCK: tl.constexpr, ONE_ROW_BLOCKS: tl.constexpr, TMA: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
):
    # Tiles as in `_gate_up_kernel`.
    num_n_blocks = tl.cdiv(hidden_size, BLOCK_N)
    tile = tl.program_id(0) // num_n_blocks
    n_block = tl.program_id(0) % num_n_blocks
    ALIGN_M: tl.constexpr = BLOCK_M // TILE_BLOCKS
    if TILE_BLOCKS == 1:
        expert, rows = _block_rows(tile, sorted_rows_ptr, block_experts_ptr, num_padded_ptr, num_rows, BLOCK_M,
                                   ONE_ROW_BLOCKS)
        if expert < 0:
            return
        _down_rows(product_ptr, w2_ptr, out_ptr, weights_ptr, expert, rows, n_block, num_rows, hidden_size,
                   intermediate_size, stride_p_row, stride_w_expert, stride_w_row, stride_out_row, s2_ptr,
                   stride_s_expert, stride_s_row, BLOCK_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION,
                   SCALE_BLOCK, TMA)
    else:
        blocks = tl.load(tiles_ptr + num_tiles + tile)
        if blocks == 0:
            return
        if blocks == 1:
            _down_tile(product_ptr, w2_ptr, out_ptr, weights_ptr, tile, blocks, tiles_ptr, sorted_rows_ptr,
                       block_experts_ptr, n_block, num_rows, hidden_size, intermediate_size, stride_p_row,
                       stride_w_expert, stride_w_row, stride_out_row, s2_ptr, stride_s_expert, stride_s_row, ALIGN_M,
                       ALIGN_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION, SCALE_BLOCK, TMA)
        elif blocks * 2 <= TILE_BLOCKS:
            _down_tile(product_ptr, w2_ptr, out_ptr, weights_ptr, tile, blocks, tiles_ptr, sorted_rows_ptr,
                       block_experts_ptr, n_block, num_rows, hidden_size, intermediate_size, stride_p_row,
                       stride_w_expert, stride_w_row, stride_out_row, s2_ptr, stride_s_expert, stride_s_row,
                       BLOCK_M // 2, ALIGN_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION, SCALE_BLOCK, TMA)
        else:
            _down_tile(product_ptr, w2_ptr, out_ptr, weights_ptr, tile, blocks, tiles_ptr, sorted_rows_ptr,
                       block_experts_ptr, n_block, num_rows, hidden_size, intermediate_size, stride_p_row,
                       stride_w_expert, stride_w_row, stride_out_row, s2_ptr, stride_s_expert, stride_s_row, BLOCK_M,
                       ALIGN_M, BLOCK_N, BLOCK_K, FLOAT32_DOT, DOT_PRECISION, SCALE_BLOCK, TMA)


@triton.jit
def _down_one_token_kernel(
    product_ptr, w2_ptr, out_ptr, weights_ptr, ids_ptr, hidden_size, stride_w_expert, stride_w_row, s2_ptr,
    stride_s_expert, stride_s_row, shared_gate_ptr, shared_ptr, logits_ptr, num_routed_experts,
    CHOICES: tl.constexpr, BLOCK_C: tl.constexpr, INTERMEDIATE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr, SHARED: tl.constexpr, ROUTE: tl.constexpr,
    ROUTE_TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALISE: tl.constexpr, ROUTE_SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token's down projection and combine in one launch: program n's BLOCK_N output columns of every choice's
    expert, each scaled by its routing weight and summed in float32 (choice order), plus a gated shared expert's
    output, rounded once. The choices are one tile `[BLOCK_C, BLOCK_K, BLOCK_N]`, so every weight load of a K tile
    is in flight at once; the first is asked for before the wait for the gate/up kernel (launched dependently, the
    weights stream beside it), and only the products are read after it. With ROUTE the program routes the token
    itself from the router's logits, as the gate/up kernel does, so nothing that kernel writes but the products is
    read."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = offs_n < hidden_size
    picks = tl.arange(0, BLOCK_C)
    chosen = picks < CHOICES
    if ROUTE:
        weights, ids = _top_k(logits_ptr, num_routed_experts, ROUTE_TOP_K, BLOCK_E, BLOCK_C, RENORMALISE)
        # Rounded to the logits' dtype, as the router launch stores them for more tokens.
        weights = weights.to(logits_ptr.dtype.element_ty).to(tl.float32)
        if ROUTE_SHARED:  # the stack's last expert, weighted by its gate's sigmoid (the logits' column after)
            gate = tl.sigmoid(tl.load(logits_ptr + num_routed_experts).to(tl.float32))
            weights = tl.where(picks == ROUTE_TOP_K, gate.to(logits_ptr.dtype.element_ty).to(tl.float32), weights)
            ids = tl.where(picks == ROUTE_TOP_K, num_routed_experts.to(tl.int64), ids)
    else:
        ids = tl.load(ids_ptr + picks, mask=chosen, other=0).to(tl.int64)
        weights = tl.load(weights_ptr + picks, mask=chosen, other=0.0).to(tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = (w2_ptr + ids[:, None, None] * stride_w_expert + offs_n[None, None, :].to(tl.int64) * stride_w_row
              + offs_k[None, :, None])
    tile_live = chosen[:, None, None] & col_live[None, None, :]
    if SCALE_BLOCK:
        scale_rows = (s2_ptr + ids[:, None] * stride_s_expert
                      + (offs_n // SCALE_BLOCK).to(tl.int64)[None, :] * stride_s_row)
    w_first = tl.load(w_rows, mask=tile_live & (offs_k < INTERMEDIATE)[None, :, None], other=0.0)
    wait_for_producer(PDL)
    acc = tl.zeros([BLOCK_C, BLOCK_N], dtype=tl.float32)
    for k_start in tl.static_range(0, INTERMEDIATE, BLOCK_K):
        k_live = offs_k < INTERMEDIATE - k_start
        if k_start == 0:
            w_tile = w_first
        else:
            w_tile = tl.load(w_rows + k_start, mask=tile_live & k_live[None, :, None], other=0.0)
        if SCALE_BLOCK:  # each column's scale for this K tile (inside one scale block)
            scales = tl.load(scale_rows + k_start // SCALE_BLOCK, mask=chosen[:, None] & col_live[None, :],
                             other=0.0).to(tl.float32)
            w_tile = (w_tile.to(tl.float32) * scales[:, None, :]).to(product_ptr.dtype.element_ty)
        p_tile = tl.load(product_ptr + picks[:, None] * INTERMEDIATE + k_start + offs_k[None, :],
                         mask=chosen[:, None] & k_live[None, :], other=0.0)
        acc += tl.sum(w_tile.to(tl.float32) * p_tile.to(tl.float32)[:, :, None], axis=1)
    release_dependents(PDL)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for choice in tl.static_range(CHOICES):
        weight = tl.sum(tl.where(picks == choice, weights, 0.0), axis=0)
        total += tl.sum(tl.where(picks[:, None] == choice, acc, 0.0), axis=0) * weight
    if SHARED:
        gate = tl.sigmoid(tl.load(shared_gate_ptr).to(tl.float32))
        total += gate * tl.load(shared_ptr + offs_n, mask=col_live, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=col_live)


# One token's down projection and combine (`_down_one_token_kernel`): the K tile (the intermediate width, up to
# this, in one tile).
ONE_TOKEN_DOWN_MAX_BLOCK_K = 512


@triton.jit
def _top_k(logits_ptr, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
           RENORMALISE: tl.constexpr):
    """(weights `[BLOCK_K]` float32, ids `[BLOCK_K]` int64; the first TOP_K in use) of one token's router logits
    at `logits_ptr`: a float32 softmax over the experts, the k largest (the lowest id among equals), renormalised."""
    offs = tl.arange(0, BLOCK_E)
    live = offs < num_experts
    logits = tl.load(logits_ptr + offs, mask=live, other=float("-inf")).to(tl.float32)
    exps = tl.where(live, tl.exp(logits - tl.max(logits, 0)), 0.0)
    probabilities = exps / tl.sum(exps, 0)
    # One reduction a pick: each expert's key is its probability's bits (ordered as the values, being >= 0) above
    # its id counted down, so the largest key is the most probable expert and the lowest id among equals. A chosen
    # or padding expert's key is -1, which the next pick passes over.
    bits = probabilities.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(live, (bits << 32) | (BLOCK_E - 1 - offs).to(tl.int64), -1)
    picks = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for pick in tl.static_range(TOP_K):
        best = tl.max(keys, 0)
        high = best >> 32
        expert = BLOCK_E - 1 - (best - (high << 32))
        weight = high.to(tl.int32).to(tl.float32, bitcast=True)
        weights = tl.where(picks == pick, weight, weights)
        ids = tl.where(picks == pick, expert, ids)
        keys = tl.where(keys == best, -1, keys)
    if RENORMALISE:
        weights = weights / tl.sum(weights, 0)
    return weights, ids


@triton.jit
def _routed_expert(choice, logits_ptr, num_routed_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, RENORMALISE: tl.constexpr, SHARED: tl.constexpr):
    """The expert of one token's `choice`-th choice, routed from its logits by `_top_k`; with SHARED, choice TOP_K
    is the shared expert, the stack's last (`num_routed_experts`)."""
    _, ids = _top_k(logits_ptr, num_routed_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALISE)
    expert = tl.sum(tl.where(tl.arange(0, BLOCK_K) == choice, ids, 0))
    if SHARED:
        expert = tl.where(choice == TOP_K, num_routed_experts.to(tl.int64), expert)
    return expert


@triton.jit
def _store_route(logits_ptr, weights_ptr, ids_ptr, weights, ids, num_experts, TOP_K: tl.constexpr,
                 BLOCK_K: tl.constexpr, SHARED: tl.constexpr):
    """One token's choices into its rows of `weights_ptr`/`ids_ptr` (TOP_K + SHARED of them), the shared expert,
    expert `num_experts` of the stack, last and weighted by its gate's sigmoid (the logits' column after the
    experts)."""
    picks = tl.arange(0, BLOCK_K)
    chosen = picks < TOP_K
    tl.store(weights_ptr + picks, weights.to(weights_ptr.dtype.element_ty), mask=chosen)
    tl.store(ids_ptr + picks, ids, mask=chosen)
    if SHARED:
        gate = tl.load(logits_ptr + num_experts).to(tl.float32)
        # Rounded to the logits' dtype before the sigmoid and after it, as torch's sigmoid of a 16-bit tensor is.
        tl.store(weights_ptr + TOP_K, tl.sigmoid(gate).to(weights_ptr.dtype.element_ty))
        tl.store(ids_ptr + TOP_K, num_experts.to(tl.int64))


@triton.jit(do_not_specialize=["num_experts"])  # a runtime scalar: the shared expert's id is stored from it
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_row, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALISE: tl.constexpr, SHARED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + token * stride_row
    weights, ids = _top_k(row_logits, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALISE)
    row = token * (TOP_K + SHARED)
    _store_route(row_logits, weights_ptr + row, ids_ptr + row, weights, ids, num_experts, TOP_K, BLOCK_K, SHARED)


def moe_route(router_logits, top_k: int, renormalise: bool, shared_expert: bool = False):
    """(weights `[T, k]` in the logits' dtype, expert ids `[T, k]` int64), most probable first, as
    `moe_reference.moe_route` computes them (float32 softmax), one program per token; with `shared_expert`, the
    logits' last column is the shared expert's gate and each token gets one more choice, `[T, k + 1]`."""
    check_route_shapes(router_logits, top_k, shared_expert)
    num_tokens, num_columns = router_logits.shape
    num_experts = num_columns - shared_expert
    choices = top_k + shared_expert
    weights = torch.empty(num_tokens, choices, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(num_tokens, choices, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        _route_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                     BLOCK_E=next_power_of_2(num_experts), BLOCK_K=next_power_of_2(top_k),
                                     RENORMALISE=renormalise, SHARED=shared_expert)
    return weights, ids


@triton.jit
def _combine_kernel(weighted_ptr, out_ptr, shared_gate_ptr, shared_ptr, hidden_size, stride_gate_row,
                    stride_shared_row, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, SHARED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = cols < hidden_size
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for choice in tl.static_range(TOP_K):
        total += tl.load(weighted_ptr + (token * TOP_K + choice) * hidden_size + cols, mask=live, other=0.0)
    if SHARED:
        gate = tl.sigmoid(tl.load(shared_gate_ptr + token * stride_gate_row).to(tl.float32))
        shared = tl.load(shared_ptr + token * stride_shared_row + cols, mask=live, other=0.0)
        total += gate * shared.to(tl.float32)
    tl.store(out_ptr + token * hidden_size + cols, total.to(out_ptr.dtype.element_ty), mask=live)


COMBINE_BLOCK_H = 1024


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, scale_block: int = 128,
              launch: MoeLaunch | None = None, shared_gate=None, shared=None):
    """hidden `[T, H]`, w13 `[E, 2I, H]` (gate rows then up rows), w2 `[E, H, I]`, topk_weights `[T, k]`, topk_ids
    `[T, k]` -> `[T, H]` in hidden's dtype (see `moe_reference.fused_moe`, also for the e4m3 experts that
    `w13_scale`/`w2_scale` scale per `scale_block`-square block, and for the gated shared expert `shared` adds).
    e4m3 tiles are dequantized in the kernel, so the weights are read at one byte each."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, scale_block)
    check_shared_shapes(hidden, shared_gate, shared)
    return _experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, scale_block, launch, shared_gate,
                    shared)


def routed_moe(hidden, router_logits, w13, w2, top_k: int, renormalise: bool, shared_expert: bool = False,
               w13_scale=None, w2_scale=None, scale_block: int = 128, launch: MoeLaunch | None = None):
    """`fused_moe` of the choices `moe_route` makes from `router_logits` (with `shared_expert`, the stack's last
    expert is the shared one and the logits' last column its gate). One token, a batch-1 decode step's, is routed
    inside both of its kernels (every program finds the same top k), so its MoE block is two launches and the down
    projection reads nothing of the gate/up kernel's but the products: launched dependently on Hopper, it loads its
    weights while the gate/up kernel runs."""
    num_tokens = hidden.shape[0]
    if num_tokens != 1:
        weights, ids = moe_route(router_logits, top_k, renormalise, shared_expert)
        return fused_moe(hidden, w13, w2, weights, ids, w13_scale, w2_scale, scale_block, launch)
    check_route_shapes(router_logits, top_k, shared_expert)
    choices = top_k + shared_expert
    # Never written nor read (both kernels route the token themselves): they give `_experts` the choices' shape.
    weights = torch.empty(1, choices, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(1, choices, dtype=torch.int64, device=router_logits.device)
    check_moe_shapes(hidden, w13, w2, weights, ids, w13_scale, w2_scale, scale_block)
    if router_logits.shape[0] != 1 or w13.shape[0] != router_logits.shape[1]:
        raise ValueError(f"router_logits must be [1, {w13.shape[0]}] for one token: a score for each expert of the "
                         f"stack (the shared expert's gate last), got {tuple(router_logits.shape)}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    num_routed = logits.shape[1] - shared_expert
    route = dict(logits_ptr=logits, num_routed_experts=num_routed, ROUTE_TOP_K=top_k,
                 BLOCK_E=next_power_of_2(num_routed), RENORMALISE=renormalise, SHARED=shared_expert)
    return _experts(hidden, w13, w2, weights, ids, w13_scale, w2_scale, scale_block, launch, None, None, route)


def _experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, scale_block, launch, shared_gate, shared,
             route: dict | None = None):
    """The launches of `fused_moe`, its inputs checked; with `route` (one token) the gate/up kernel writes
    `topk_weights` and `topk_ids` itself from the router's logits."""
    num_tokens, top_k = topk_ids.shape
    num_experts, double_intermediate, hidden_size = w13.shape
    intermediate_size = double_intermediate // 2
    num_rows = num_tokens * top_k
    if num_rows == 0:
        return torch.zeros_like(hidden)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    launch = launch or launch_for(num_rows, num_experts)
    scaled = w13_scale is not None
    if scaled and scale_block % launch.block_k:
        raise ValueError(f"launch block_k {launch.block_k} must divide the scale block {scale_block}")
    if scaled:
        w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    one_row_blocks = num_tokens == 1  # a token's choices are distinct experts: each row is a block of its own
    tile_blocks = 1 if one_row_blocks else launch.tile_blocks
    if one_row_blocks:  # the kernels read each row's expert from the ids; no alignment to launch
        block_experts = topk_ids.reshape(-1).contiguous()  # the same storage when routing writes it
        sorted_rows = num_padded = tiles = block_experts  # never read
        num_tiles = num_rows
    else:
        aligned = (align_in_one_launch(topk_ids, num_experts, launch.block_m)
                   if alignment_for(num_tokens, num_rows, launch) == "one_launch"
                   else align_in_parallel(topk_ids, num_experts, launch.block_m // tile_blocks, tile_blocks))
        sorted_rows, block_experts, num_padded, _, tiles, num_tiles = aligned
        tiles = num_padded if tiles is None else tiles  # never read when a tile is a block
    product = torch.empty(num_rows, intermediate_size, dtype=hidden.dtype, device=hidden.device)
    tma = launch.tma and tma_tiles_fit(w13, w2, launch)
    if tma:  # each stack as one 2-D tensor of weight rows, read in [BLOCK_N, BLOCK_K] tiles
        w13_arg = TensorDescriptor.from_tensor(w13.view(-1, hidden_size), [launch.block_n, launch.block_k])
        w2_arg = TensorDescriptor.from_tensor(w2.view(-1, intermediate_size), [launch.down[0], launch.block_k])
    else:
        w13_arg, w2_arg = w13, w2
    common = dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, FLOAT32_DOT=INTERPRETED,
                  DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", num_warps=launch.num_warps,
                  num_stages=launch.num_stages, SCALE_BLOCK=scale_block if scaled else 0,
                  ONE_ROW_BLOCKS=one_row_blocks, TILE_BLOCKS=tile_blocks)
    # Unscaled experts pass their weight as the (never read) scale pointer; without routing, the logits and route
    # weights pointers are never read either.
    s13, s2 = (w13_scale, w2_scale) if scaled else (w13, w2)
    routing = route is not None
    route = route or dict(logits_ptr=hidden, num_routed_experts=num_experts, ROUTE_TOP_K=1, BLOCK_E=1,
                          RENORMALISE=False, SHARED=False)
    # One token's two launches go dependently (the down projection's weights stream beside the gate/up kernel).
    pdl = one_row_blocks and dependent_launch(hidden.device)
    if one_row_blocks and launch.one_token_gemv:
        block_n, block_k = launch.one_token_gate_up_block_n, launch.one_token_gate_up_block_k
        if scaled and block_k > scale_block:
            block_k = scale_block  # a K tile inside one scale block
        _gate_up_one_token_kernel[(num_rows * cdiv(intermediate_size, block_n),)](
            hidden, w13, product, block_experts, hidden_size, w13.stride(0), w13.stride(1), s13, s13.stride(0),
            s13.stride(1), cdiv(intermediate_size, scale_block), route["logits_ptr"], route["num_routed_experts"],
            INTERMEDIATE=intermediate_size, BLOCK_N=block_n, BLOCK_K=block_k,
            SCALE_BLOCK=scale_block if scaled else 0, ROUTE=routing, ROUTE_TOP_K=route["ROUTE_TOP_K"],
            BLOCK_E=route["BLOCK_E"], BLOCK_TOP_K=next_power_of_2(route["ROUTE_TOP_K"]),
            RENORMALISE=route["RENORMALISE"], SHARED=route["SHARED"], PDL=pdl,
            num_warps=launch.one_token_gate_up_warps, launch_pdl=pdl,
        )
    else:
        grid = (num_tiles * cdiv(intermediate_size, launch.block_n),)
        _gate_up_kernel[grid](
            hidden, w13_arg, product, sorted_rows, block_experts, num_padded, tiles, num_tiles, num_rows, top_k,
            hidden_size,
            intermediate_size, hidden.stride(0), w13.stride(0), w13.stride(1), product.stride(0), s13, s13.stride(0),
            s13.stride(1), cdiv(intermediate_size, scale_block), **route,
            BLOCK_TOP_K=next_power_of_2(route["ROUTE_TOP_K"]), ROUTE=routing, TMA=tma, PDL=pdl, launch_pdl=pdl,
            **common,
        )
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if shared is None:
        gate_arg = shared_arg = out  # never read
    else:  # the gate may be a column of the router's logits: read through its row stride, not copied
        gate_arg, shared_arg = shared_gate, shared.contiguous()
    if one_row_blocks:  # one token: the down projection sums its choices itself, no combine launch
        block_k = min(next_power_of_2(intermediate_size), ONE_TOKEN_DOWN_MAX_BLOCK_K)
        if scaled and scale_block % block_k:
            block_k = launch.block_k  # a K tile inside one scale block (checked above)
        _down_one_token_kernel[(cdiv(hidden_size, launch.one_token_down_block_n),)](
            product, w2, out, topk_weights.reshape(-1).contiguous(), block_experts, hidden_size, w2.stride(0),
            w2.stride(1), s2, s2.stride(0), s2.stride(1), gate_arg, shared_arg, route["logits_ptr"],
            route["num_routed_experts"], CHOICES=top_k, BLOCK_C=next_power_of_2(top_k),
            INTERMEDIATE=intermediate_size, BLOCK_N=launch.one_token_down_block_n, BLOCK_K=block_k,
            SCALE_BLOCK=scale_block if scaled else 0, SHARED=shared is not None, ROUTE=routing,
            ROUTE_TOP_K=route["ROUTE_TOP_K"], BLOCK_E=route["BLOCK_E"], RENORMALISE=route["RENORMALISE"],
            ROUTE_SHARED=route["SHARED"], PDL=pdl, num_warps=launch.one_token_down_warps, launch_pdl=pdl,
        )
        return out
    weighted = torch.empty(num_rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    down_block_n, down_warps, down_stages = launch.down
    grid = (num_tiles * cdiv(hidden_size, down_block_n),)
    _down_kernel[grid](
        product, w2_arg, weighted, topk_weights.reshape(-1).contiguous(), sorted_rows, block_experts, num_padded,
        tiles, num_tiles, num_rows, hidden_size, intermediate_size, product.stride(0), w2.stride(0), w2.stride(1),
        weighted.stride(0), s2, s2.stride(0), s2.stride(1), TMA=tma,
        **dict(common, BLOCK_N=down_block_n, num_warps=down_warps, num_stages=down_stages),
    )
    # The k rows of a token and the gated shared expert summed in float32 and rounded once, in one launch (torch
    # sums 16-bit values in float32 too; the unfused ops also rounded the gate, its product and the sum).
    _combine_kernel[(num_tokens, cdiv(hidden_size, COMBINE_BLOCK_H))](
        weighted, out, gate_arg, shared_arg, hidden_size, gate_arg.stride(0), shared_arg.stride(0), TOP_K=top_k,
        BLOCK_H=COMBINE_BLOCK_H, SHARED=shared is not None,
    )
    return out
