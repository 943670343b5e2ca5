"""The batch context: the flat description of one engine step that model code reads.

The runner builds one `BatchContext` per forward pass; the model never sees requests, only these tensors. A step
holds N sequences and T tokens laid out back to back: the first `num_decodes` sequences are 1-token decode steps,
the rest are prefill chunks (a chunk may continue a prompt whose earlier tokens are already cached).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class StateCaptures:
    """Checkpoints a step takes inside its prefill chunks: each GDN layer's state after a chunk's first 64m tokens
    (m >= 1), written to checkpoint slots while the chunk runs on.

    chunk_slots: int32 [prefill chunks] on the device, a checkpoint slot per 64-token chunk of the prefill sequences
      (numbered in batch order, `ceil(query_len / 64)` per sequence), -1 for none: the recurrent state before it.
    conv_rows: int64 [captures, W-1], rows of the step's prefill tokens (counted from the first prefill token): the
      W-1 inputs before each capture point, which are the conv state there.
    conv_slots: int64 [captures], the checkpoint slot of each capture.
    """

    chunk_slots: torch.Tensor
    conv_rows: torch.Tensor
    conv_slots: torch.Tensor


def attention_apart(num_decodes: int, num_seqs: int) -> bool:
    """Whether a step launches attention twice, its decode rows and its prefill chunks apart: when it has both. The
    model (`BatchContext.attention_parts`) and the warm-up's plan (`warmup.attention_launches`) both ask here."""
    return 0 < num_decodes < num_seqs


@dataclass(frozen=True)
class AttentionRows:
    """The rows of one paged-attention launch of a step: tokens [first, end) and their sequences' offsets (counted
    from `first`), context lengths, block tables and longest query and context."""

    first: int
    end: int
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass
class BatchContext:
    """One step's batch layout.

    num_decodes: the first `num_decodes` sequences are single-token decode steps; the rest are prefill chunks.
    cu_seqlens_q: int32 [N+1] on the model's device, cumulative query tokens per sequence (starts at 0).
    cu_seqlens_q_cpu: the same offsets as a host list, so the model never syncs to read them.
    seq_lens: int32 [N], context length of each sequence after this step (cached + new tokens).
    block_tables: int32 [N, max_blocks], token-pool blocks of each sequence, 0-padded (block 0 is the null block).
    slot_mapping: int64 [T], token-pool position of each new token's K/V: block * block_size + offset.
    state_slot_ids: int32 [N], state-pool slot per sequence; 0 (the null slot) only for padding rows.
    max_seqlen_q: the longest query length in the batch.
    max_seqlen_k: the longest context length in the batch.
    state_captures: prefix caching's checkpoints inside this step's prefill chunks, None for none.
    prefill_on_null_slot: whether a prefill chunk of this step runs on the null slot (the start-up profiling pass
      does); when none does, the GDN prefill has no rows to zero.
    decode_max_seqlen_k / prefill_max_seqlen_k: the longest context of the decode rows and of the prefill chunks
      (None: `max_seqlen_k`), which size their attention launches apart (`attention_parts`).
    between_layers: called after each layer's token mixer is launched, in a step the model runs layer by layer
      (eagerly or piecewise; a replayed decode graph calls nothing): the engine reads the previous step's tokens
      there once the device has finished it, rather than after the whole launch.

    The prefill chunks' own offsets and slots (`prefill_cu_seqlens`, ...) are derived once per step and shared by
    every GDN layer.
    """

    num_decodes: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_q_cpu: list[int]
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    state_slot_ids: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    state_captures: "StateCaptures | None" = None
    prefill_on_null_slot: bool = True
    decode_max_seqlen_k: int | None = None
    prefill_max_seqlen_k: int | None = None
    between_layers: Callable[[], None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q_cpu) - 1

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_q_cpu[-1]

    @property
    def num_decode_tokens(self) -> int:
        """Decode rows come first and hold one token each, so their tokens are the first `num_decodes` rows."""
        return self.cu_seqlens_q_cpu[self.num_decodes]

    @cached_property
    def decode_slot_ids(self) -> torch.Tensor:
        return self.state_slot_ids[: self.num_decodes]

    @cached_property
    def prefill_slot_ids(self) -> torch.Tensor:
        return self.state_slot_ids[self.num_decodes :]

    @cached_property
    def prefill_cu_seqlens(self) -> torch.Tensor:
        """Offsets of the prefill chunks counted from the first prefill token (int32, on the device)."""
        return self.cu_seqlens_q[self.num_decodes :] - self.num_decodes if self.num_decodes else self.cu_seqlens_q

    @cached_property
    def prefill_cu_seqlens_cpu(self) -> list[int]:
        return [offset - self.num_decodes for offset in self.cu_seqlens_q_cpu[self.num_decodes :]]

    @cached_property
    def attention_parts(self) -> list[AttentionRows]:
        """The step's paged-attention launches: one, or in a step with both decode rows and prefill chunks, one for
        each. A single launch sizes its tiles for the longest query, so beside a prefill chunk every decode row
        would take a 128-row tile of which its heads fill four, and the chunk's few query blocks would walk their
        keys without the split that fills the SMs."""
        num_decodes = self.num_decodes
        if not attention_apart(num_decodes, self.num_seqs):
            return [AttentionRows(0, self.num_tokens, self.cu_seqlens_q, self.seq_lens, self.block_tables,
                                  self.max_seqlen_q, self.max_seqlen_k)]
        return [
            AttentionRows(0, num_decodes, self.cu_seqlens_q[: num_decodes + 1], self.seq_lens[:num_decodes],
                          self.block_tables[:num_decodes], 1, self.decode_max_seqlen_k or self.max_seqlen_k),
            AttentionRows(num_decodes, self.num_tokens, self.prefill_cu_seqlens, self.seq_lens[num_decodes:],
                          self.block_tables[num_decodes:], self.max_seqlen_q,
                          self.prefill_max_seqlen_k or self.max_seqlen_k),
        ]
