"""Small Triton helpers shared by the kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hybridkv.errors import UserError

# Triton's CPU interpreter multiplies bfloat16 dot operands as raw bits: under it, kernels pass their (already
# rounded) tiles to tl.dot as float32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(x: int, y: int) -> int:
    """`triton.cdiv` for the host side of a launch: recent Triton makes that one a constexpr function whose wrapper
    costs microseconds a call, and a mixed step's launches make hundreds of these calls."""
    return (x + (y - 1)) // y


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for the host side of a launch (the same values: 0 for 0, else the least power of two
    at or above n)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


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


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel before it on
# the stream runs on, once that one's programs have all signalled (`release_dependents`) or exited. Its programs load
# what the kernel before does not write (weights, pooled states) and then wait (`wait_for_producer`) until that kernel
# has finished and its writes are visible, before reading its outputs or writing anything. Each such kernel signals
# only after its own wait, so whenever one starts, every kernel before the one it follows has finished: what the
# pre-wait loads read must only not be written by the kernel directly before. `HYBRIDKV_DEPENDENT_LAUNCH=off` turns
# it off (the kernels then wait on the launch order alone, as every other kernel does).
DEPENDENT_LAUNCH_MODES = ("on", "off")


@functools.cache
def dependent_launch_mode() -> str:
    """`HYBRIDKV_DEPENDENT_LAUNCH` (default on), read once per process."""
    mode = os.environ.get("HYBRIDKV_DEPENDENT_LAUNCH", "on")
    if mode not in DEPENDENT_LAUNCH_MODES:
        raise UserError(f"HYBRIDKV_DEPENDENT_LAUNCH={mode[:40]!r} is not one of {', '.join(DEPENDENT_LAUNCH_MODES)}; "
                        "unset it or pick one")
    return mode


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels that support it launch dependently on `device`: CUDA on Hopper or later, unless turned off;
    never under the interpreter."""
    if dependent_launch_mode() == "off" or device.type != "cuda" or INTERPRETED:
        return False
    return hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """In a dependently launched kernel: wait until the kernel before it has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """In a dependently launched kernel, after its wait: let the next kernel's programs start."""
    if PDL:
        gdc_launch_dependents()


@functools.cache
def hopper_or_later(device_index: int) -> bool:
    """Compute capability 9.0 or later: the tensor memory accelerator (TMA) and grid dependency control."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def device_limits(device: torch.device) -> tuple[int, int]:
    """(multiprocessors, opt-in shared memory per block in bytes); each asked of the driver once per GPU, since the
    launch paths of a mixed step ask hundreds of times."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_multiprocessors(index), _max_shared_memory_bytes(index)
    # The interpreter: a small "GPU", so tiny shapes still take the paths large ones take there; Hopper's shared
    # memory.
    return 4, 232_448


def split_k_for(device: torch.device, programs: int, k_tiles: int, programs_per_sm: int = 4,
                min_tiles_per_share: int = 4) -> int:
    """How many programs share each output tile's K walk: the smallest power of two that gives `programs_per_sm`
    programs per multiprocessor, within an eighth (their loads in flight together hide memory latency), while each
    share keeps `min_tiles_per_share` K tiles (skinny GEMMs with a long K, such as a down projection at decode
    sizes, otherwise leave most of the GPU idle). The eighth's tolerance: on the H200's 132 multiprocessors,
    Qwen3.5-9B's one-token W4A16 down projection took 12.4 us in 512 programs and 14.3 in 1,024."""
    target = programs_per_sm * device_limits(device)[0]
    split = 1
    while (8 * programs * split < 7 * target and k_tiles // (split * 2) >= min_tiles_per_share
           and split < 16):
        split *= 2
    return split


@functools.cache
def _cuda_multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _max_shared_memory_bytes(device_index: int) -> int:
    """The per-block limit Triton checks every launch against (the driver's opt-in maximum)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


@triton.jit
def finish_split_k(value, y_ptrs, shares_ptrs, share_stride, counter_ptr, share, mask, SPLIT_K: tl.constexpr):
    """Ends a split-K program: `value` (float32) is its share `share` of one output tile. Each share is stored in
    the float32 workspace (`shares_ptrs` address share 0, `share_stride` apart); the tile's counter then counts the
    shares in, and the program that brings the last sums all of them in share order (the result does not depend on
    which finished first), stores the tile at `y_ptrs` in their dtype and resets the counter to zero for the next
    launch. No second kernel reduces the shares."""
    tl.store(shares_ptrs + share * share_stride, value, mask=mask)
    tl.debug_barrier()  # every thread's share stored before the counter says so
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.zeros_like(value)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(shares_ptrs + s * share_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


# Counter buffers by (device type, index, stream); never freed, since a captured CUDA graph keeps their addresses.
_SPLIT_K_COUNTERS: dict[tuple, list[torch.Tensor]] = {}
_SPLIT_K_COUNTER_BLOCK = 1 << 16


def split_k_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for `finish_split_k`, one per output tile, kept per device and stream (each launch
    leaves them at zero again, so launches on one stream reuse them, CUDA graph replays included)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buffers = _SPLIT_K_COUNTERS.setdefault((device.type, device.index, stream), [])
    if not buffers or buffers[-1].numel() < tiles:
        size = _SPLIT_K_COUNTER_BLOCK * cdiv(max(tiles, 1), _SPLIT_K_COUNTER_BLOCK)
        buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


def split_k_workspace(y: torch.Tensor, split_k: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(shares, counters) for a launch that ends with `finish_split_k` into `y`: a float32 workspace of `split_k`
    copies of y's shape and the stream's counters for `tiles` output tiles; with one share, y itself twice (never
    read)."""
    if split_k == 1:
        return y, y
    shares = torch.empty(split_k, *y.shape, dtype=torch.float32, device=y.device)
    return shares, split_k_counters(y.device, tiles)
