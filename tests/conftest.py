"""Shared test set-up: reproducible seeds, the hypothesis CI profile, and the Triton interpreter on CPU.

Every random input in the suite comes from `seed` (or `rng`, `torch_generator`): the seed is printed with each test
(`-rA` or a failure shows it) and can be fixed for a rerun with HYBRIDKV_TEST_SEED=<n>.
"""

from __future__ import annotations

import os
import random
import zlib

# Triton kernels run under the interpreter when no GPU is present; it must be chosen before triton is imported.
if os.environ.get("HYBRIDKV_TRITON_INTERPRET", "auto") != "0":
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except ImportError:  # torch-free install: no kernels to interpret
        pass


def _round_bfloat16_to_nearest() -> None:
    """The interpreter casts float32 to bfloat16 by dropping the low bits (toward zero, about 2^-9 smaller on
    average); the GPU rounds to nearest even. Every rounding in a chain of bf16 matmul operands then shrinks the result,
    about 1 % over a few chunks of the gated delta rule. Cast as the GPU does, so interpreted kernels carry the GPU's
    rounding error and not a bias of the interpreter's."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.asarray(src.data, dtype=np.float32)
            rounded = torch.from_numpy(data.reshape(-1).copy()).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(rounded.view(np.uint16).reshape(data.shape), tl.bfloat16)
        return truncating(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _round_bfloat16_to_nearest()
    except ImportError:  # no triton or torch: nothing is interpreted
        pass

import pytest
from hypothesis import HealthCheck, settings

# 2-core CI machines are slow and noisy: no per-example deadline, and a bounded number of examples.
settings.register_profile(
    "ci", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _base_seed() -> int:
    return int(os.environ.get("HYBRIDKV_TEST_SEED", "20261129"))


@pytest.fixture
def seed(request) -> int:
    """A per-test seed derived from the base seed and the test id; printed so a failure can be replayed."""
    value = (_base_seed() + zlib.crc32(request.node.nodeid.encode())) % (2**31)
    print(f"[seed] {request.node.nodeid}: {value} (base HYBRIDKV_TEST_SEED={_base_seed()})")
    random.seed(value)
    try:
        import torch

        torch.manual_seed(value)
    except ImportError:
        pass
    return value


@pytest.fixture
def rng(seed) -> random.Random:
    return random.Random(seed)


@pytest.fixture
def torch_generator(seed):
    torch = pytest.importorskip("torch")
    return torch.Generator().manual_seed(seed)
