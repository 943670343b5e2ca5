"""Host values onto the device without making the host wait for it.

`torch.tensor(values, device="cuda")`, or `.to("cuda")` of a tensor in pageable memory, copies synchronously: the
copy first waits for everything already queued on the stream, so the host stalls behind the step it has just
launched and the next step's host work no longer overlaps the device. Through pinned memory the copy is queued like
a kernel and the host goes on; the caching host allocator keeps the pinned buffer until the copy has run.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a flat list of numbers) as a 1-D `dtype` tensor on `device`, queued without a host wait."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def staged_int64(packed: array, device: torch.device) -> torch.Tensor:
    """`packed` (an int64 array) as a host tensor to copy to `device` with `non_blocking=True`: pinned on a CUDA
    device (a copy of it, which the caching host allocator keeps until the transfer has run), the array's own memory
    otherwise."""
    host = torch.frombuffer(packed, dtype=torch.long) if len(packed) else torch.empty(0, dtype=torch.long)
    return host.pin_memory() if device.type == "cuda" else host
