"""Small Triton helpers shared by the kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter multiplies bfloat16 dot operands as raw bits: under it, kernels pass their (already
# rounded) tiles to tl.dot as float32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def search_steps(num_seqs: int) -> int:
    """Halvings `find_sequence` needs to pin one of `num_seqs` sequences."""
    return max(1, int(num_seqs).bit_length())


@triton.jit
def find_sequence(cu_seqlens_ptr, num_seqs, num_search_steps, target, BLOCK_ROWS: tl.constexpr,
                  BLOCKS_PER_SEQ_PAD: tl.constexpr):
    """Index n of the last sequence whose first block is at or before `target` (a scalar or a vector).

    Sequence n's first block is `cu_seqlens[n] // BLOCK_ROWS + n * BLOCKS_PER_SEQ_PAD`: with BLOCK_ROWS=1 and no pad
    this is the sequence a token belongs to (empty sequences are skipped); with a pad of 1 it maps a grid's query
    block to its sequence. A fixed number of halvings keeps the search free of host syncs.
    """
    lo = target * 0
    hi = lo + num_seqs - 1
    for _ in range(num_search_steps):
        mid = (lo + hi + 1) // 2
        first_block = tl.load(cu_seqlens_ptr + mid) // BLOCK_ROWS + mid * BLOCKS_PER_SEQ_PAD
        at_or_before = first_block <= target
        lo = tl.where(at_or_before, mid, lo)
        hi = tl.where(at_or_before, hi, mid - 1)
    return lo


@triton.jit
def round_to_e4m3_grid(v):
    """v rounded to the nearest e4m3 value (ties to even, as the GPU's conversion), still in float32: 3 mantissa
    bits, subnormals below 2^-6."""
    exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))), -6.0)
    ulp = tl.exp2(exponent - 3.0)
    steps = tl.abs(v) / ulp
    low = tl.floor(steps)
    up = (steps - low > 0.5) | ((steps - low == 0.5) & (low % 2 == 1))
    return tl.where(v < 0, -1.0, 1.0) * (low + up.to(tl.float32)) * ulp


def device_limits(device: torch.device) -> tuple[int, int]:
    """(multiprocessors, opt-in shared memory per block in bytes)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(device).multi_processor_count, _max_shared_memory_bytes(index)
    # The interpreter: a small "GPU", so tiny shapes still take the paths large ones take there; Hopper's shared
    # memory.
    return 4, 232_448


def split_k_for(device: torch.device, programs: int, k_tiles: int, programs_per_sm: int = 4,
                min_tiles_per_share: int = 4) -> int:
    """How many programs share each output tile's K walk: the smallest power of two that gives `programs_per_sm`
    programs per multiprocessor (their loads in flight together hide memory latency), while each share keeps
    `min_tiles_per_share` K tiles (skinny GEMMs with a long K, such as a down projection at decode sizes, otherwise
    leave most of the GPU idle)."""
    target = programs_per_sm * _multiprocessors(device)
    split = 1
    while programs * split < target and k_tiles // (split * 2) >= min_tiles_per_share and split < 16:
        split *= 2
    return split


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return device_limits(device)[0]
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _max_shared_memory_bytes(device_index: int) -> int:
    """The per-block limit Triton checks every launch against (the driver's opt-in maximum)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
