"""Checks shared by the CPU (Triton interpreter) and GPU kernel tests."""

from __future__ import annotations

import contextlib

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives inf so it never passes."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


@contextlib.contextmanager
def poisoned_allocations():
    """Every float tensor torch.empty/empty_like returns meanwhile is NaN-filled, so an output element (or scratch
    entry) a kernel fails to write shows up as NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def changed_unnamed_slots(before: torch.Tensor, after: torch.Tensor, named: list[int]) -> list[int]:
    """Slots (null slot 0 included) not in `named` whose bytes changed."""
    return [s for s in range(before.shape[0]) if s not in named and not same_bits(before[s], after[s])]
