"""What the GDN stages share: the gates in Triton, the l2norm epsilon, and the state pool layout the in-place
kernels need.

State pool `[slots, HV, V, K]` (V-first), float32 or bfloat16, slot 0 null. The kernels that write the pool in place
run with fixed launch configurations: an autotuner would re-run them and apply the update twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import L2NORM_EPS, SOFTPLUS_THRESHOLD

EPS = tl.constexpr(L2NORM_EPS)
_THRESHOLD = tl.constexpr(SOFTPLUS_THRESHOLD)


def require_state_layout(ssm_state: torch.Tensor) -> None:
    hv, v, k = ssm_state.shape[1:]
    if ssm_state.stride()[1:] != (v * k, k, 1):
        raise ValueError("ssm_state must be contiguous within a slot ([slots, HV, V, K] with unit stride along K)")


@triton.jit
def gates(a, b, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), in float32."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    softplus = tl.where(x > _THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, _THRESHOLD))))
    return -tl.exp(A_log.to(tl.float32)) * softplus, tl.sigmoid(b.to(tl.float32))
