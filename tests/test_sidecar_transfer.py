"""The step inputs' way to the device: `PinnedStaging` copies every packed array whole into its target, refuses
what is not an int64 array or a matching int64 target, and on a GPU reuses its few pinned buffers only once the copy
queued from each has run."""

from __future__ import annotations

import random
from array import array

import pytest

torch = pytest.importorskip("torch")

from hybridkv.sidecar.core.transfer import PinnedStaging  # noqa: E402

CPU = torch.device("cpu")


def test_on_cpu_the_packed_array_is_the_tensor_and_copies_land_whole():
    staging = PinnedStaging(CPU)
    packed = array("q", [5, -1, 2**40, 0, 7])
    assert staging.to_device(packed).tolist() == packed.tolist()
    assert staging.to_device(array("q")).shape == (0,)
    out = torch.full((5,), -9, dtype=torch.long)
    staging.copy_into(packed, out)
    assert out.tolist() == packed.tolist()


@pytest.mark.parametrize("packed", [array("i", [1, 2]), array("d", [1.0, 2.0]), array("B", bytes(16))])
def test_values_that_are_not_int64_are_refused(packed):
    with pytest.raises(TypeError, match="int64 array"):
        PinnedStaging(CPU).copy_into(packed, torch.zeros(len(packed), dtype=torch.long))


@pytest.mark.parametrize("out", [torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.int32),
                                 torch.zeros(8, dtype=torch.long)[::2]])
def test_a_target_of_another_size_dtype_or_layout_is_refused_and_left_alone(out):
    before = out.clone()
    with pytest.raises(ValueError, match="contiguous int64 tensor of 4 elements"):
        PinnedStaging(CPU).copy_into(array("q", [1, 2, 3, 4]), out)
    assert torch.equal(out, before)


def test_a_ring_needs_a_buffer():
    with pytest.raises(ValueError, match="at least one buffer"):
        PinnedStaging(CPU, buffers=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_each_copy_lands_whole_while_the_ring_wraps_behind_a_busy_stream():
    """Eight stagings through two buffers, sizes growing past the first capacity and shrinking back, all queued
    behind a kernel that keeps the stream busy: a buffer rewritten before the copy from it ran would corrupt an
    earlier target."""
    device = torch.device("cuda")
    staging = PinnedStaging(device, buffers=2)
    rng = random.Random(11)
    sizes = [3, 9_000, 70_000, 1, 40_000, 8_192, 120_000, 5]
    arrays = [array("q", (rng.randrange(-2**62, 2**62) for _ in range(size))) for size in sizes]
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time ahead of every copy
    targets = []
    for index, packed in enumerate(arrays):
        if index % 2:
            target = torch.full((len(packed),), -1, dtype=torch.long, device=device)
            staging.copy_into(packed, target)
        else:
            target = staging.to_device(packed)
        targets.append(target)
    torch.cuda.synchronize()
    for packed, target in zip(arrays, targets):
        assert target.device.type == "cuda" and target.tolist() == packed.tolist()
    assert sum(buffer is not None for buffer in staging._buffers) == 2
    assert all(buffer.is_pinned() for buffer in staging._buffers)


class _Event:
    """Stands in for a CUDA event: whether the copy recorded on it has been waited for."""

    def __init__(self, log):
        self.log, self.recorded, self.waited = log, False, False

    def record(self, stream):
        # The buffer was written just before this: the copy recorded from it last time must have been waited for.
        assert not self.recorded or self.waited, "a buffer was rewritten before the copy from it was waited for"
        self.recorded, self.waited = True, False

    def synchronize(self):
        self.waited = True
        self.log.append("wait")


class _RingOnHostMemory(PinnedStaging):
    """The ring's own logic, followed on the CPU: host buffers for pinned ones, events that note each wait and check
    at every record that the copy recorded from that buffer before was waited for."""

    def __init__(self, buffers):
        super().__init__(torch.device("cuda"), buffers)  # takes the device path; nothing here touches a GPU
        self.log = []

    def _new_buffer(self, elements):
        self.log.append(f"new {elements}")
        return torch.empty(elements, dtype=torch.long)

    def _new_event(self):
        return _Event(self.log)

    @staticmethod
    def _stream(out):
        return None


def test_the_ring_reuses_its_buffers_in_turn_after_waiting_and_grows_a_buffer_a_larger_step_needs():
    ring = _RingOnHostMemory(buffers=2)
    rng = random.Random(5)
    for size in (3, 9_000, 5, 70_000, 70_000, 2):
        packed = array("q", (rng.randrange(-2**62, 2**62) for _ in range(size)))
        out = torch.full((size,), -1, dtype=torch.long)
        ring.copy_into(packed, out)
        assert out.tolist() == packed.tolist()
    # Buffer 0 takes stagings 1, 3, 5 and buffer 1 stagings 2, 4, 6; each reuse waits first; a buffer grows to the
    # next power of two only when a staging outgrows it.
    assert ring.log == ["new 8192", "new 16384", "wait", "wait", "new 131072", "wait", "new 131072", "wait"]
    ring.copy_into(array("q"), torch.empty(0, dtype=torch.long))  # nothing to copy: the ring is not touched
    assert len(ring.log) == 8 and ring._next == 0
