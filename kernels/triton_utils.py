"""Small Triton helpers shared by the kernels."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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
# has finished and its writes are visible, before reading its outputs or writing anything.
# `HYBRIDKV_DEPENDENT_LAUNCH=off` turns it off (the kernels then wait on the launch order alone, as every other kernel
# does).
#
# When a kernel signals decides how far ahead the next one's pre-wait loads may run:
# - After its own wait (`release_dependents`; `release_after_wait` without EARLY): whenever the next kernel starts,
#   every kernel before this one has finished, so the next kernel's pre-wait loads need only not read what this one
#   writes. The MoE kernels signal so: the down projection routes its token from the router's logits before its wait.
# - At its start (`release_at_start` with EARLY, `early_release`): the next kernel's programs take the multiprocessors
#   as soon as this one's are all placed and ask for their weights while this kernel, and kernels before it that
#   signalled early too, still run. The decode chain's kernels signal so (norms, the q/k norms with rotary, the K/V
#   write, attention and its merge, the conv and GDN decodes, GEMVs of weights under 32 MiB). Every kernel that follows
#   one of them reads before its wait only what no kernel of the step writes: weights and parameters, or a layer's
#   pooled conv or recurrent state, which only that layer's own decode kernel writes, once a step. Torch's and cuBLAS's
#   kernels launch in plain order and still wait for everything before them. In a 0.8B batch-1 decode step on an H100
#   this took the step from 0.96 to 0.90 ms (docs/performance.md, 2026-12-07); `HYBRIDKV_EARLY_RELEASE=off` turns it
#   off.
SWITCH_MODES = ("on", "off")


def _switch(name: str) -> str:
    """The environment switch `name` (default on), refused by name unless one of `SWITCH_MODES`."""
    mode = os.environ.get(name, "on")
    if mode not in SWITCH_MODES:
        raise UserError(f"{name}={mode[:40]!r} is not one of {', '.join(SWITCH_MODES)}; unset it or pick one")
    return mode


def _hopper_feature(mode: str, device: torch.device) -> bool:
    """Whether a Hopper feature switched `mode` is used on `device`: CUDA on Hopper or later, unless switched off;
    never under the interpreter."""
    if mode == "off" or device.type != "cuda" or INTERPRETED:
        return False
    return hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def dependent_launch_mode() -> str:
    """`HYBRIDKV_DEPENDENT_LAUNCH` (default on), read once per process."""
    return _switch("HYBRIDKV_DEPENDENT_LAUNCH")


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels that support it launch dependently on `device` (`_hopper_feature`)."""
    return _hopper_feature(dependent_launch_mode(), device)


@functools.cache
def early_release_mode() -> str:
    """`HYBRIDKV_EARLY_RELEASE` (default on), read once per process."""
    return _switch("HYBRIDKV_EARLY_RELEASE")


def early_release(device: torch.device) -> bool:
    """Whether the decode chain's kernels let the next kernel start at their own start (`release_at_start`) on
    `device`: where they launch dependently, unless switched off."""
    return early_release_mode() == "on" and dependent_launch(device)


@triton.jit
def release_at_start(PDL: tl.constexpr, EARLY: tl.constexpr):
    """At a dependently launched kernel's start, with EARLY: let the next kernel's programs start now."""
    if PDL:
        if EARLY:
            gdc_launch_dependents()


@triton.jit
def release_after_wait(PDL: tl.constexpr, EARLY: tl.constexpr):
    """After a dependently launched kernel's wait: `release_dependents` unless it let them start already (EARLY)."""
    if PDL:
        if not EARLY:
            gdc_launch_dependents()


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


# Weight bytes asked of the L2 cache ahead of their projection (Hopper and later). A decode step at small batch is a
# chain of projections, each streaming its weights from memory, with short kernels between them during which memory
# sits idle. The layer norm before a projection takes extra programs that issue L2 prefetches of the head of that
# projection's weights (`prefetch.global.L2::evict_last`, one 128-byte line an instruction) and exit without waiting
# for them: the projection then finds its first bytes in L2. A prefetch is a hint (nothing waits for it, nothing
# depends on it). `HYBRIDKV_L2_PREFETCH=off` turns it off.
#
# Chosen on an H100 (docs/performance.md, 2026-12-07): in norm-then-projection chains, one program per
# multiprocessor and at most 4 MiB a tensor (bulk prefetches from fewer programs, or of whole tensors, slowed the
# chains: the norm ran longer than its projection gained). In the engine at batch 1, the 4B's step went 3.50 -> 3.42
# ms; the 0.8B's, whose projections are 4-17 MB, 1.00 -> 1.01 ms, hence the size floor; the GDN decode prefetching
# its output projection cost the 0.8B another 1.5 %, so no kernel but the norm prefetches.
# At most this many rows (decode tokens) launch with prefetches (measured at 1 and 16; past it the projections run
# as GEMMs that keep the memory busy on their own).
L2_PREFETCH_MAX_ROWS = 16
# Tensors smaller than this are not prefetched; a launch prefetches at most two tensors, and of each at most its
# first `L2_PREFETCH_MAX_BYTES`.
L2_PREFETCH_MIN_BYTES = 32 << 20
L2_PREFETCH_MAX_BYTES = 4 << 20
L2_PREFETCH_SLOTS = 2
L2_LINE_BYTES = 128
_L2_LINE = tl.constexpr(L2_LINE_BYTES)


@functools.cache
def l2_prefetch_mode() -> str:
    """`HYBRIDKV_L2_PREFETCH` (default on), read once per process."""
    return _switch("HYBRIDKV_L2_PREFETCH")


@dataclass(frozen=True)
class PrefetchLimits:
    """What a launch prefetches: tensors of at least `min_bytes`, of each at most its first `max_bytes`, at up to
    `max_rows` rows, over `programs` extra programs (None: one per multiprocessor). The defaults are the module's
    constants; `bench/kernel_speed.py --only=norm_prefetch --sweep` times others."""

    min_bytes: int = L2_PREFETCH_MIN_BYTES
    max_bytes: int = L2_PREFETCH_MAX_BYTES
    max_rows: int = L2_PREFETCH_MAX_ROWS
    programs: int | None = None


DEFAULT_PREFETCH_LIMITS = PrefetchLimits()


@dataclass(frozen=True)
class L2Prefetch:
    """The prefetch arguments of one launch: its `programs` extra programs, and per slot (two) the tensor whose
    address is the base, the bytes to ask for from there and the bytes each thread asks for (0 bytes: an empty
    slot)."""

    programs: int
    tensors: tuple[torch.Tensor, torch.Tensor]
    num_bytes: tuple[int, int]
    lane_bytes: tuple[int, int]

    def args(self) -> tuple:
        """The kernel arguments, slot by slot: (pointer, bytes, bytes per thread)."""
        return (self.tensors[0], self.num_bytes[0], self.lane_bytes[0],
                self.tensors[1], self.num_bytes[1], self.lane_bytes[1])


def l2_prefetch_plan(tensors, rows: int, lanes: int, device: torch.device,
                     limits: PrefetchLimits = DEFAULT_PREFETCH_LIMITS) -> L2Prefetch | None:
    """The prefetches a launch of `rows` rows issues for `tensors` (the projection after it reads them), `lanes`
    threads a program, within `limits`; None when it issues none: prefetching is off or unsupported here, the batch
    is past `limits.max_rows`, or no tensor qualifies."""
    if not tensors or rows > limits.max_rows or not l2_prefetch_supported(device):
        return None
    return plan_l2_prefetch(tensors, lanes, limits.programs or device_limits(device)[0], limits)


def plan_l2_prefetch(tensors, lanes: int, programs: int,
                     limits: PrefetchLimits = DEFAULT_PREFETCH_LIMITS) -> L2Prefetch | None:
    """`l2_prefetch_plan` past its device and batch checks: the slots for `tensors` over `programs` x `lanes`
    threads. A tensor qualifies when it is contiguous and at least `limits.min_bytes`; the two largest are taken,
    each to at most `limits.max_bytes`, split evenly over the threads in whole lines."""
    chosen = sorted((t for t in tensors if t.is_contiguous() and t.numel() * t.element_size() >= limits.min_bytes),
                    key=lambda t: t.numel() * t.element_size(), reverse=True)[:L2_PREFETCH_SLOTS]
    if not chosen:
        return None
    threads = programs * lanes
    num_bytes = [min(t.numel() * t.element_size(), limits.max_bytes) for t in chosen]
    lane_bytes = [L2_LINE_BYTES * max(1, cdiv(cdiv(n, threads), L2_LINE_BYTES)) for n in num_bytes]
    while len(chosen) < L2_PREFETCH_SLOTS:
        chosen.append(chosen[0])
        num_bytes.append(0)
        lane_bytes.append(L2_LINE_BYTES)
    return L2Prefetch(programs, tuple(chosen), tuple(num_bytes), tuple(lane_bytes))


def no_prefetch_args(tensor: torch.Tensor) -> tuple:
    """The slot arguments of a launch without prefetches (never read: the kernel compiles them out)."""
    return (tensor, 0, L2_LINE_BYTES, tensor, 0, L2_LINE_BYTES)


def l2_prefetch_supported(device: torch.device) -> bool:
    """Whether launches on `device` take prefetch programs (`_hopper_feature`)."""
    return _hopper_feature(l2_prefetch_mode(), device)


@triton.jit
def _line_prefetches(ptr, num_bytes, lane_bytes, lane):
    """This thread's span of one slot (`lane_bytes` from `lane * lane_bytes`, cut at `num_bytes`), asked of the L2
    a line at a time."""
    start = lane * lane_bytes
    end = tl.minimum(start + lane_bytes, num_bytes)
    base = ptr.to(tl.pointer_type(tl.int8))
    for offset in range(0, lane_bytes, _L2_LINE):
        at = start + offset
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [base + at, (at < end).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_to_l2(a_ptr, a_bytes, a_lane_bytes, b_ptr, b_bytes, b_lane_bytes, program, LANES: tl.constexpr):
    """Extra program `program` of a launch with prefetches (`L2Prefetch.args` give the slots): each of its LANES
    threads asks the L2 for its span of each slot, and the program goes on without waiting for the bytes."""
    lane = program.to(tl.int64) * LANES + tl.arange(0, LANES)
    _line_prefetches(a_ptr, a_bytes, a_lane_bytes, lane)
    _line_prefetches(b_ptr, b_bytes, b_lane_bytes, lane)


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
