"""Qwen3-Next's Gated DeltaNet projections, read from the fused tensors its checkpoints store.

Qwen3-Next stores `in_proj_qkvz` and `in_proj_ba` grouped by key head: key head h holds its q rows, its k rows, then
the v and z rows of the value heads it serves (`linear_num_value_heads / linear_num_key_heads` of them), and likewise
b then a. The model keeps Qwen3.5's merged `in_proj_qkvzba` ([q | k | v | z | b | a], each split by heads), so the
forward pass is the same for both; these rows are reordered into it once, at load. A rank holds whole key heads with
their value heads, so it reads one contiguous block of rows of each tensor. FP8 checkpoints store `in_proj_qkvz` in
e4m3 with its `weight_scale_inv` grid in the same grouped order, one scale row per 128 weight rows; with head dims
that are multiples of 128 every head's rows are whole blocks, so the grid is regrouped the same way, block by block
(`in_proj_ba` stays in 16 bits, as those checkpoints keep it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.sidecar.model.layers import CheckpointSlice, ShardLayout, ShardPart

MODEL_TYPE = "qwen3_next"


@dataclass(frozen=True)
class KeyHeadGroupedLayout:
    """How a checkpoint tensor grouped by key head fills consecutive parts of a merged parameter's `ShardLayout`."""

    merged: ShardLayout
    num_key_heads: int

    def checkpoint_shape(self, param_shape: torch.Size, first_part: int, num_parts: int) -> tuple[int, ...]:
        return self.merged.checkpoint_shape(param_shape, first_part, num_parts)

    def load(self, param: torch.Tensor, source: CheckpointSlice, first_part: int, num_parts: int) -> None:
        parts = self.merged.parts[first_part : first_part + num_parts]
        rows_per_head = [part.full_size // self.num_key_heads for part in parts]
        first_head, held_heads, _ = ShardPart(self.num_key_heads).rank_units(self.merged.tp_rank, self.merged.tp_size)
        head_rows = sum(rows_per_head)
        block = source[first_head * head_rows : (first_head + held_heads) * head_rows]
        pieces = block.view(held_heads, head_rows, -1).split(rows_per_head, dim=1)
        offsets = self.merged.rank_offsets()[first_part : first_part + num_parts]
        for offset, piece in zip(offsets, pieces):
            rows = piece.reshape(-1, piece.shape[-1])
            param.narrow(0, offset, rows.shape[0]).copy_(rows)


def read_key_head_grouped(in_proj_qkvzba: torch.nn.Parameter, num_key_heads: int) -> None:
    """Point the loader at `in_proj_qkvz` (parts q, k, v, z) and `in_proj_ba` (parts b, a) for this parameter."""
    layout = KeyHeadGroupedLayout(in_proj_qkvzba.shard_layout, num_key_heads)
    in_proj_qkvzba.checkpoint_sources = (("in_proj_qkvz", layout, 0, 4), ("in_proj_ba", layout, 4, 2))


def read_quantized_key_head_grouped(model: nn.Module, num_key_heads: int) -> None:
    """Point the loader's entries for a quantized model's `in_proj_qkvz` and `in_proj_ba` children (their weights and
    scale grids, each over its own shard parts) at the key-head-grouped rows the checkpoint stores."""
    for name, module in model.named_modules():
        if not name.endswith(".linear_attn.in_proj_qkvzba"):
            continue
        for child in module.children():
            for param in child.parameters(recurse=False):
                if param.shard_layout.dim == 0:
                    param.grouped_layout = KeyHeadGroupedLayout(param.shard_layout, num_key_heads)
