"""Tensor-parallel building blocks of the model: linear layers, embeddings, norms, rotary, activations.

Sharding follows the usual Megatron split. Column-parallel layers hold a slice of the output features and need no
communication; row-parallel layers hold a slice of the input features and all-reduce their partial sums; the vocabulary
is split by rows across ranks for both the embedding and the head. With `tp_size == 1` nothing touches
`torch.distributed`.

Every sharded parameter carries a `ShardLayout` (attribute `shard_layout`) that says which rows or columns of the
checkpoint tensor this rank holds, so the loader can read exactly those from a safetensors slice without
materialising the full tensor. A layout is a list of parts along one dimension, each part `num_units` units of
`unit_size` rows: a merged projection `[q | k | v | z]` is four parts, each split by heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import gated_rms_norm, linear, rms_norm, rotary, silu_and_mul
from hybridkv.sizing.errors import TensorParallelError


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise TensorParallelError(
            f"tensor parallel size {denominator} does not divide {what} ({numerator}); "
            f"choose a tensor parallel size that divides it"
        )
    return numerator // denominator


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        torch.distributed.all_reduce(x)
    return x


class CheckpointSlice(Protocol):
    """What the loader hands a parameter: a safetensors slice, or a tensor (both index lazily or cheaply)."""

    def __getitem__(self, index): ...


@dataclass(frozen=True)
class ShardPart:
    """`num_units` consecutive units of `unit_size` rows (or columns) of a checkpoint tensor, split across ranks.

    Units are heads (unit_size = head_dim) or single features (unit_size = 1). When there are fewer units than ranks
    (KV heads under a large tp), each rank holds one unit and ranks share it, as vLLM replicates KV heads.
    """

    num_units: int
    unit_size: int = 1

    def rank_units(self, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
        """(first unit, units held from the checkpoint, units allocated) on this rank."""
        if self.num_units < tp_size:
            return tp_rank * self.num_units // tp_size, 1, 1
        per_rank = -(-self.num_units // tp_size)
        first = min(tp_rank * per_rank, self.num_units)
        return first, min(per_rank, self.num_units - first), per_rank

    def rank_size(self, tp_rank: int, tp_size: int) -> int:
        return self.rank_units(tp_rank, tp_size)[2] * self.unit_size

    @property
    def full_size(self) -> int:
        return self.num_units * self.unit_size


@dataclass(frozen=True)
class ShardLayout:
    """Which slice of the checkpoint tensor a parameter holds on one rank; `dim` None means replicated."""

    dim: int | None
    parts: tuple[ShardPart, ...]
    tp_rank: int
    tp_size: int

    def rank_offsets(self) -> list[int]:
        """Offset of each part inside this rank's parameter, along `dim`."""
        offsets, total = [], 0
        for part in self.parts:
            offsets.append(total)
            total += part.rank_size(self.tp_rank, self.tp_size)
        return offsets

    def checkpoint_shape(self, param_shape: torch.Size, first_part: int, num_parts: int) -> tuple[int, ...]:
        """Shape of the checkpoint tensor holding parts [first_part, first_part + num_parts) in full."""
        if self.dim is None:
            return tuple(param_shape)
        shape = list(param_shape)
        shape[self.dim] = sum(p.full_size for p in self.parts[first_part : first_part + num_parts])
        return tuple(shape)

    def load(self, param: torch.Tensor, source: CheckpointSlice, first_part: int, num_parts: int) -> None:
        """Copy this rank's rows of parts [first_part, first_part + num_parts) from `source` into `param`."""
        if self.dim is None:
            param.copy_(source[:])
            return
        offsets = self.rank_offsets()
        source_offset = 0
        for index in range(first_part, first_part + num_parts):
            part = self.parts[index]
            first_unit, held_units, allocated_units = part.rank_units(self.tp_rank, self.tp_size)
            start = source_offset + first_unit * part.unit_size
            rows = held_units * part.unit_size
            target = param.narrow(self.dim, offsets[index], allocated_units * part.unit_size)
            selector = (slice(None),) * self.dim + (slice(start, start + rows),)
            if rows:
                target.narrow(self.dim, 0, rows).copy_(source[selector])
            # Padding rows past the vocabulary stay zero so they never win a gather or an argmax tie.
            target.narrow(self.dim, rows, target.shape[self.dim] - rows).zero_()
            source_offset += part.full_size


def sharded_parameter(shape, dtype, device, dim: int | None = None, parts=(), tp_rank: int = 0,
                      tp_size: int = 1) -> nn.Parameter:
    """An uninitialised inference parameter of this rank's `shape`, carrying where it comes from in the checkpoint."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.shard_layout = ShardLayout(dim, tuple(parts), tp_rank, tp_size)
    return param


class MergedColumnParallelLinear(nn.Module):
    """Bias-free projections of the same input (one or several), concatenated on the output, split by rows across ranks.

    `output_parts` lists each projection's `ShardPart` in output order; each rank holds its share of every part, in
    the same order, so `split(output_sizes)` on the local output gives the local piece of each projection.
    """

    def __init__(self, in_features: int, output_parts: list[ShardPart], *, dtype, device, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__()
        self.output_sizes = [part.rank_size(tp_rank, tp_size) for part in output_parts]
        self.weight = sharded_parameter((sum(self.output_sizes), in_features), dtype, device, 0, output_parts,
                                        tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """A bias-free linear layer whose input features are split across ranks; partial outputs are all-reduced."""

    def __init__(self, input_part: ShardPart, out_features: int, *, dtype, device, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__()
        divide(input_part.num_units, tp_size, "the input units of a row-parallel layer")
        self.tp_size = tp_size
        self.weight = sharded_parameter((out_features, input_part.rank_size(tp_rank, tp_size)), dtype, device, 1,
                                        [input_part], tp_rank, tp_size)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output, before the all-reduce (for callers that sum several partials at once)."""
        return linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x), self.tp_size)


class VocabParallelEmbedding(nn.Module):
    """Token embeddings split by vocabulary rows; each rank embeds the ids it holds and the ranks sum the rows."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, device, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        part = ShardPart(vocab_size)
        first, _, self.rows_per_rank = part.rank_units(tp_rank, tp_size)
        self.vocab_start = first
        self.vocab_end = first + self.rows_per_rank
        self.weight = sharded_parameter((self.rows_per_rank, hidden_size), dtype, device, 0, [part], tp_rank,
                                        tp_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * held
        embeddings = F.embedding(local_ids, self.weight) * held.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(embeddings, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to the vocabulary, split by rows; the logits of all ranks are gathered on every rank."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local_logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return local_logits
        shards = [torch.empty_like(local_logits) for _ in range(self.tp_size)]
        torch.distributed.all_gather(shards, local_logits.contiguous())
        return torch.cat(shards, dim=-1)[..., : self.vocab_size]


def projection_tensors(*projections: nn.Module) -> tuple[torch.Tensor, ...]:
    """The tensors the projections read, for the kernel before them to ask the L2 cache for at small batch
    (`kernels.rms_norm`'s `prefetch`; the kernel takes the largest)."""
    return tuple(param for projection in projections for param in projection.parameters())


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm of Qwen3.5: `norm(x) * (1 + w)` in fp32, optionally fused with the residual add.

    With a residual, returns (normed, new residual) where the new residual is `x + residual` in the input dtype,
    the same sum the reference computes before its norm.
    """

    def __init__(self, dim: int, eps: float, *, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = sharded_parameter((dim,), dtype, device)
        # The group of the FP8 projections this norm feeds (`fp8_input_group`), which then get its output quantized.
        self.fp8_group: int | None = None
        # What the projection after this norm reads (`projection_tensors`), which the kernel asks the L2 cache for at
        # decode sizes; set once the model's projections are final.
        self.prefetch: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual, self.fp8_group, self.prefetch)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values with a plain weight, then multiplied by SiLU of the gate (norm before gate)."""

    def __init__(self, dim: int, eps: float, *, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = sharded_parameter((dim,), dtype, device)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """NeoX rotary over the first `rotary_dim` dims of each head; the rest pass through.

    Angles are computed per step from the positions (no table sized by the maximum length, nothing to sync), in fp32
    and cast to the activation dtype as the reference does. Qwen3.5's M-RoPE equals this 1-D rotary for text, where
    the temporal, height and width positions are all the token position.
    """

    def __init__(self, rotary_dim: int, base: float, *, device):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D], positions [T] -> rotated (q, k)."""
        return rotary(positions, q, k, self.inv_freq, self.rotary_dim)


class SiluAndMul(nn.Module):
    """SwiGLU activation over a merged [gate | up] projection; `fp8_group` as RMSNorm's."""

    def __init__(self):
        super().__init__()
        self.fp8_group: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, self.fp8_group)
