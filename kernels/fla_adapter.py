"""Every call into flash-linear-attention (fla): the kkt-and-solve kernel and the output stage that the GDN prefill
path runs, and the stages and whole ops the GPU tests and benchmarks hold ours against (`anchor`), with the bounds
and the gate units fla's chunk stages take.

These are fla's internals, not its public API, so importing this module checks the installed fla-core against the
releases they were tested with (pyproject's pin states the same range) and refuses any other by name. fla's own
modules are imported on first call: that takes seconds, and runs under the Triton interpreter never reach them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re

import torch

from hybridkv.errors import UserError

from .triton_utils import cdiv

# The fla-core releases whose internals these calls were tested against: at least the first, below the second.
FLA_CORE_LOWEST = "0.6.0"
FLA_CORE_BELOW = "0.7"
SUPPORTED_FLA_CORE = f">={FLA_CORE_LOWEST},<{FLA_CORE_BELOW}"

# Tokens per chunk of fla's chunk_gated_delta_rule (its default).
FLA_CHUNK_TOKENS = 64
# fla's chunk stages take the gates' chunk sums in log2 units, scaled by its float32 1/ln 2.
RCP_LN2 = 1.4426950216

# fla's stages and ops that the GPU tests and benchmarks compare ours with, by the module that defines each.
_ANCHOR_MODULES = {
    "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule",
    "chunk_gated_delta_rule_fwd_intra": "fla.ops.gated_delta_rule.chunk_fwd",
    "recompute_w_u_fwd": "fla.ops.gated_delta_rule.wy_fast",
    "chunk_gated_delta_rule_fwd_h": "fla.ops.common.chunk_delta_h",
    "chunk_local_cumsum": "fla.ops.utils",
}


class FlaVersionError(UserError):
    """The installed fla-core is missing or outside the releases whose internals the kernels were tested with."""


def _release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string, padded to three (`0.6` is `0.6.0`); None if it has none."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        return None
    numbers = tuple(int(part) for part in match.group().split("."))
    return numbers + (0,) * (3 - len(numbers))


def check_fla_core_version(installed: str | None) -> None:
    """Raise `FlaVersionError` unless `installed` (None: not installed) is within `SUPPORTED_FLA_CORE`."""
    install = f"pip install 'fla-core{SUPPORTED_FLA_CORE}'"
    if installed is None:
        raise FlaVersionError(f"fla-core is not installed; the GDN prefill kernels need fla-core{SUPPORTED_FLA_CORE} "
                              f"({install}), or set HYBRIDKV_KERNELS=reference")
    release = _release(installed)
    if release is None or not _release(FLA_CORE_LOWEST) <= release < _release(FLA_CORE_BELOW):
        raise FlaVersionError(f"fla-core {installed[:40]} is installed, but the GDN prefill kernels call fla internals "
                              f"tested only with fla-core{SUPPORTED_FLA_CORE}: {install}")


def _installed_fla_core() -> str | None:
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


check_fla_core_version(_installed_fla_core())


@functools.lru_cache(maxsize=8)
def chunk_bounds(bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's `cu_seqlens` (int64), `chunk_indices` (sequence, chunk within it) and `chunk_offsets` (each sequence's
    first chunk) for these sequence bounds, built on the host and copied from pinned memory, so nothing waits for
    the device (fla derives them on the device, the indices through a blocking copy). Cached: every GDN layer of a
    step has the same bounds."""
    chunks = [-(-(bounds[n + 1] - bounds[n]) // FLA_CHUNK_TOKENS) for n in range(len(bounds) - 1)]
    indices = [(n, chunk) for n, count in enumerate(chunks) for chunk in range(count)]
    offsets = [0]
    for count in chunks:
        offsets.append(offsets[-1] + count)
    host = (torch.tensor(bounds, dtype=torch.long), torch.tensor(indices, dtype=torch.long).view(-1, 2),
            torch.tensor(offsets, dtype=torch.long))
    if device.type == "cuda":
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in host)
    return tuple(t.to(device) for t in host)


# fla's tuned kernels past their wrappers: (kernel, the caller's key) -> (JIT function, the keyword arguments the
# wrappers add), or None where they cannot be skipped.
_SETTLED: dict[tuple, tuple | None] = {}


def _settled_arguments(kernel, kwargs: dict) -> tuple | None:
    """What fla's wrappers around `kernel` (Triton heuristics and autotuners, outermost first) add to a launch with
    `kwargs`, right after such a launch: each heuristic's value and the configuration its autotuner just ran with.
    (JIT function, those keyword arguments), or None if a wrapper is of another kind or runs hooks per launch."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    added: dict = {}
    fn = kernel
    while not isinstance(fn, JITFunction):
        if isinstance(fn, Heuristics):
            for name, rule in fn.values.items():
                added[name] = rule({**kwargs, **added})
        elif isinstance(fn, Autotuner):
            config = getattr(fn, "best_config", None)
            if config is None or config.pre_hook is not None:
                return None
            added.update(config.all_kwargs())
        else:
            return None
        fn = fn.fn
    return fn, added


def _launch_tuned(kernel, grid, key: tuple, **kwargs) -> None:
    """Launches one of fla's kernels wrapped in heuristics and an autotuner. fla tunes these on head counts and dims
    alone and its heuristics ask only which optional inputs are given, so for one `key` (the caller's geometry,
    dtypes and device) the wrappers add the same arguments every launch: the first launch goes through them and
    settles those, later ones go straight to the JIT function with them. The wrappers' key building and lookups
    cost about 15 µs of Python a launch, two launches per GDN layer of every mixed step (docs/performance.md)."""
    entry = (kernel, key)
    settled = _SETTLED.get(entry)
    if settled is not None:
        fn, added = settled
        fn[grid](**kwargs, **added)
        return
    kernel[grid](**kwargs)
    if entry not in _SETTLED:
        _SETTLED[entry] = _settled_arguments(kernel, kwargs)


def kkt_solve(k, g_cumsum, beta, bounds):
    """fla's fused kkt-and-solve kernel: A `[T, HV, 64]`, each chunk's (I + strictly-lower(beta k k^T decay))^-1.
    Only the lower triangles are written; `gdn_wy.wy_form` and `gdn_state.folded_chunk_states` read no more, so A is
    not zero-filled first (fla's own intra stage zero-fills it before the solve and forms w and u after it)."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel

    cu_seqlens, chunk_indices, _ = bounds
    tokens, num_k_heads, k_dim = k.shape
    hv = beta.shape[1]
    A = torch.empty(tokens, hv, FLA_CHUNK_TOKENS, dtype=k.dtype, device=k.device)
    # fla's kernels take a batch of one varlen sequence set, addressed through the pointers and T, H, K alone: the
    # tensors go in without their leading batch dim (a view per tensor and layer less host work).
    _launch_tuned(
        chunk_gated_delta_rule_fwd_kkt_solve_kernel, (chunk_indices.shape[0], hv),
        (num_k_heads, hv, k_dim, k.dtype, g_cumsum.dtype, beta.dtype, k.device),
        k=k, g=g_cumsum, beta=beta, A=A, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        T=tokens, H=num_k_heads, HV=hv, K=k_dim, BT=FLA_CHUNK_TOKENS, BC=16,
    )
    return A


def output_stage(q, k, v_new, h, g_cumsum, scale: float, bounds):
    """fla's output stage: o `[T, HV, V]` from the states before each chunk (V-first) and the new values. Its kernel
    is launched here as `chunk_fwd_o` launches it, without that function's backend dispatch, which costs more host
    time per layer than the launch itself in an eager mixed step."""
    from fla.ops.common.chunk_o import chunk_fwd_kernel_o

    cu_seqlens, chunk_indices, _ = bounds
    tokens, num_k_heads, k_dim = q.shape
    hv, v_dim = v_new.shape[1], v_new.shape[2]
    chunks = chunk_indices.shape[0]
    o = torch.empty(tokens, hv, v_dim, dtype=v_new.dtype, device=v_new.device)
    _launch_tuned(
        chunk_fwd_kernel_o, lambda meta: (cdiv(v_dim, meta["BV"]) * chunks, hv),
        (num_k_heads, hv, k_dim, v_dim, q.dtype, k.dtype, v_new.dtype, h.dtype, g_cumsum.dtype, q.device),
        q=q, k=k, v=v_new, h=h, g=g_cumsum, g_gamma=None, o=o, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=tokens, H=num_k_heads, HV=hv, K=k_dim, V=v_dim,
        BT=FLA_CHUNK_TOKENS, STATE_V_FIRST=True,
    )
    return o.to(q.dtype)


def anchor(name: str):
    """fla's function `name` (a key of `_ANCHOR_MODULES`), for the GPU tests and benchmarks to compare against."""
    return getattr(importlib.import_module(_ANCHOR_MODULES[name]), name)
