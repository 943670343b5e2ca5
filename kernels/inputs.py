"""Random kernel inputs of a given geometry, shared by the kernel tests and `bench/kernel_speed.py`.

Values are drawn like a real layer's (normal activations, A_log = log U(1, 16), states of modest norm); slot 0 and
block 0 of the pools hold NaN so that any read of them shows in the results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GdnGeometry:
    """One GDN layer's head geometry (per tensor-parallel rank)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def state_bytes_fp32(self) -> int:
        return self.num_v_heads * self.head_v_dim * self.head_k_dim * 4


def _normal(shape, generator, device, dtype, std=1.0):
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(device=device, dtype=dtype)


def gdn_step_inputs(geometry: GdnGeometry, rows: int, generator, device="cpu", dtype=torch.bfloat16) -> dict:
    """qkv `[rows, conv_dim]`, a/b `[rows, HV]` and the layer's A_log/dt_bias (fp32)."""
    hv = geometry.num_v_heads
    return {
        "qkv": _normal((rows, geometry.conv_dim), generator, device, dtype),
        "a": _normal((rows, hv), generator, device, dtype),
        "b": _normal((rows, hv), generator, device, dtype),
        "A_log": torch.empty(hv).uniform_(1, 16, generator=generator).log().to(device),
        "dt_bias": _normal((hv,), generator, device, torch.float32, std=0.5),
    }


def state_pools(geometry: GdnGeometry, slots: int, generator, device="cpu", ssm_dtype=torch.float32,
                conv_dtype=torch.bfloat16):
    """conv `[slots + 1, conv_dim, W-1]` and ssm `[slots + 1, HV, V, K]` pools; the null slot 0 holds NaN."""
    conv = _normal((slots + 1, geometry.conv_dim, geometry.conv_kernel - 1), generator, device, conv_dtype)
    ssm = _normal((slots + 1, geometry.num_v_heads, geometry.head_v_dim, geometry.head_k_dim), generator, device,
                  ssm_dtype, std=0.05)
    conv[0] = float("nan")
    ssm[0] = float("nan")
    return conv, ssm


def conv_weight(geometry: GdnGeometry, generator, device="cpu", dtype=torch.bfloat16):
    return _normal((geometry.conv_dim, geometry.conv_kernel), generator, device, dtype, std=0.5)


def cu_seqlens_of(lengths: list[int], device="cpu") -> torch.Tensor:
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return torch.tensor(bounds, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class AttentionGeometry:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int = 256
    block_size: int = 16


def paged_attention_inputs(geometry: AttentionGeometry, seq_lens: list[int], q_lens: list[int], generator,
                           device="cpu", dtype=torch.bfloat16, spare_blocks: int = 3,
                           kv_dtype: torch.dtype | None = None) -> dict:
    """Random q and a paged K/V pool (in `kv_dtype`, default q's) whose blocks are scattered in a random order
    (block 0 null, NaN-filled)."""
    bs = geometry.block_size
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    max_blocks = max(blocks_per_seq + [1])
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    taken = 0
    for n, count in enumerate(blocks_per_seq):
        block_tables[n, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int32)
        taken += count
    cache_shape = (num_blocks, bs, geometry.num_kv_heads, geometry.head_dim)
    # Drawn in float32 and NaN-filled there: an fp8 tensor takes neither on every backend.
    k_cache = _normal(cache_shape, generator, "cpu", torch.float32)
    v_cache = _normal(cache_shape, generator, "cpu", torch.float32)
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    k_cache, v_cache = (pool.to(device=device, dtype=kv_dtype or dtype) for pool in (k_cache, v_cache))
    total_q = sum(q_lens)
    return {
        "q": _normal((total_q, geometry.num_q_heads, geometry.head_dim), generator, device, dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables.to(device),
        "cu_seqlens_q": cu_seqlens_of(q_lens, device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "scale": geometry.head_dim**-0.5,
        "max_seqlen_q": max(q_lens),
        "max_seqlen_k": max(seq_lens),
    }
