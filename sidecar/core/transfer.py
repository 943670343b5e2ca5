"""Host values onto the device without making the host wait for it.

`torch.tensor(values, device="cuda")`, or `.to("cuda")` of a tensor in pageable memory, copies synchronously: the
copy first waits for everything already queued on the stream, so the host stalls behind the step it has just
launched and the next step's host work no longer overlaps the device. Through pinned memory the copy is queued like
a kernel and the host goes on; the caching host allocator keeps the pinned buffer until the copy has run.

A step's packed inputs go through `PinnedStaging` instead: a few pinned buffers the runner owns and reuses in turn.
`Tensor.pin_memory()` allocates a pinned tensor and copies into it with torch's CPU copy, which spreads a copy of
more than 32,768 elements over every intra-op thread; a decode step of 256 requests with 4k-token contexts packs about
70,000, and on an H100's host that copy, its threads' wake-ups and the allocation took about 1.2 ms of each decode
step's host time at concurrency 256 (docs/performance.md). A plain `memmove` into a buffer already pinned takes tens
of microseconds.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence

import torch

# Buffers in the ring: a buffer is written again only after this many later stagings (a step stages one), and the
# engine has at most one step in flight while it launches the next, so the copy queued from it has run long before
# (its event is synchronized all the same).
STAGING_BUFFERS = 4
MIN_STAGING_ELEMENTS = 1 << 13  # 64 KiB of int64: a small model's decode step fits the first buffers


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a flat list of numbers) as a 1-D `dtype` tensor on `device`, queued without a host wait."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class PinnedStaging:
    """int64 host-to-device copies through a ring of pinned buffers, each written with one `memmove` and reused
    once the copy queued from it has run (its CUDA event). On a CPU device the packed array's own memory is the
    tensor, as there is nothing to copy to."""

    def __init__(self, device: torch.device, buffers: int = STAGING_BUFFERS):
        if buffers < 1:
            raise ValueError(f"a staging ring needs at least one buffer, got {buffers}")
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * buffers
        self._events: list[torch.cuda.Event | None] = [None] * buffers
        self._next = 0

    def to_device(self, packed: array) -> torch.Tensor:
        """`packed` (an int64 array) as a new 1-D int64 tensor on the device, queued without a host wait."""
        if self.device.type != "cuda":
            return self._host_view(packed)
        out = torch.empty(len(packed), dtype=torch.long, device=self.device)
        self.copy_into(packed, out)
        return out

    def copy_into(self, packed: array, out: torch.Tensor) -> None:
        """Queue the copy of `packed` (an int64 array) into `out` (int64, contiguous, as many elements, on the
        device) on the current stream."""
        if packed.itemsize != 8 or packed.typecode not in "ql":
            raise TypeError(f"staged values must be an int64 array, got typecode {packed.typecode!r}")
        if out.dtype != torch.long or not out.is_contiguous() or out.numel() != len(packed):
            raise ValueError(f"the staging target must be a contiguous int64 tensor of {len(packed)} elements, got "
                             f"{out.dtype} {tuple(out.shape)}")
        if self.device.type != "cuda":
            out.copy_(self._host_view(packed))
            return
        if not len(packed):
            return
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        event = self._events[index]
        if event is None:
            event = self._events[index] = self._new_event()
        else:
            event.synchronize()  # the copy queued from this buffer len(ring) stagings ago
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < len(packed):
            capacity = max(MIN_STAGING_ELEMENTS, 1 << (len(packed) - 1).bit_length())
            buffer = self._buffers[index] = self._new_buffer(capacity)
        address, count = packed.buffer_info()
        ctypes.memmove(buffer.data_ptr(), address, count * 8)
        stream = self._stream(out)
        out.copy_(buffer[:count], non_blocking=True)  # queued on `stream`, the target's device's current stream
        event.record(stream)

    # The device's parts of the ring, apart so the ring's order can be followed without a GPU.
    @staticmethod
    def _new_buffer(elements: int) -> torch.Tensor:
        return torch.empty(elements, dtype=torch.long, pin_memory=True)

    @staticmethod
    def _new_event():
        return torch.cuda.Event()

    @staticmethod
    def _stream(out: torch.Tensor):
        return torch.cuda.current_stream(out.device)

    @staticmethod
    def _host_view(packed: array) -> torch.Tensor:
        return torch.frombuffer(packed, dtype=torch.long) if len(packed) else torch.empty(0, dtype=torch.long)
