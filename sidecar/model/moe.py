"""The sparse mixture-of-experts feed-forward of Qwen3.5/3.6-MoE and Qwen3-Next.

A softmax router over all experts picks each token's top k (renormalised to sum to one when the config's
`norm_topk_prob` says so; Qwen3.5-MoE always renormalises), the chosen experts' SwiGLUs run in one fused kernel, and a
shared expert, scaled by a sigmoid gate of its own, is added. The math follows transformers' `Qwen3_5MoeSparseMoeBlock`
and `Qwen3NextSparseMoeBlock`: router logits in the model dtype, softmax in fp32, weights cast back to the model
dtype.

Experts are stacked once, at construction, in the layout the fused kernel reads: `experts.gate_up_proj`
`[E, 2I, H]` (gate rows, then up rows) and `experts.down_proj` `[E, H, I]`, the 3-D tensors Qwen3.5-MoE checkpoints
store. Checkpoints with one tensor per expert (`experts.N.{gate,up,down}_proj.weight`, as Qwen3-Next ships and
transformers' `save_pretrained` writes) load into the same stacks: each parameter's `expert_parts` and
`expert_layout` tell the loader where expert N's tensors go. Tensor parallel splits every expert's intermediate
dimension across ranks; the router and the shared-expert gate are replicated (one projection of E + 1 rows), and
the routed and shared partial sums are all-reduced together, once. Where the shared expert is as wide as a routed one
and stored in the same format (every published Qwen3.5/3.6-MoE and Qwen3-Next checkpoint), it is loaded as one more
expert of the stack, `[E + 1, ...]`, and the router gives each token a last choice of it weighted by the gate's
sigmoid: the fused kernel then runs it with the routed experts, where a separate SwiGLU cost a decode step four more
launches a layer. FP8 checkpoints store each expert projection in
e4m3 with a `weight_scale_inv` per 128 x 128 block (`experts.N.gate_proj.weight_scale_inv`, ...): the stacks stay
e4m3 and the scale grids are stacked beside them, which needs every rank to hold whole blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv import kernels
from hybridkv.sidecar.model.layers import (ShardLayout, ShardPart, all_reduce, divide, projection_tensors,
                                           sharded_parameter)
from hybridkv.sizing import ModelGeometry
from hybridkv.sizing.quantization import UnsupportedQuantizationError

# Qwen3.5-MoE's router has no `norm_topk_prob` switch: it always renormalises the top-k probabilities.
ALWAYS_RENORMALISED_MODEL_TYPES = ("qwen3_5_moe_text",)


class RouterWeight(nn.Module):
    """The router's projection and the shared expert's gate as one weight `[E + 1, H]` every rank holds whole: rows
    0..E-1 score the experts (the checkpoint's `mlp.gate.weight`), row E gates the shared expert
    (`mlp.shared_expert_gate.weight`), so one GEMM makes both, where a separate one-row product of the gate cost two
    more launches a layer (cuBLAS runs it as a dot product and a reduction)."""

    def __init__(self, num_experts: int, hidden_size: int, par):
        super().__init__()
        # tp_size 1 in the layout: every rank loads both checkpoint tensors whole.
        self.weight = sharded_parameter((num_experts + 1, hidden_size), par.dtype, par.device, 0,
                                        (ShardPart(num_experts), ShardPart(1)))
        layout = self.weight.shard_layout
        self.weight.checkpoint_sources = (("gate", layout, 0, 1), ("shared_expert_gate", layout, 1, 1))


def _expert_stack(shape, dtype, par, dim: int, parts: tuple[ShardPart, ...], projections, suffix: str,
                  shared_slot: int | None):
    """One stacked expert parameter `[E, ...]` (`[E + 1, ...]` with the shared expert in slot `shared_slot`) that the
    loader also fills from each expert's checkpoint tensors (`mlp.experts.N.<projection>.<suffix>`, and
    `mlp.shared_expert.<projection>.<suffix>` for the shared slot), split along `dim` (of the stack) over `parts`."""
    param = sharded_parameter(shape, dtype, par.device, dim, parts, par.tp_rank, par.tp_size)
    param.expert_parts = projections
    param.expert_layout = ShardLayout(dim - 1, parts, par.tp_rank, par.tp_size)
    param.expert_suffix = suffix
    param.shared_slot = shared_slot
    return param


class StackedExperts(nn.Module):
    """All experts' weights of one layer, this rank's slice of each expert's intermediate features; with
    `with_shared`, the shared expert's as the last of them. FP8 checkpoints' experts stay e4m3, with each projection's
    `weight_scale_inv` grid stacked beside them (gate blocks, then up blocks) in `gate_up_proj_scale_inv` and
    `down_proj_scale_inv`."""

    def __init__(self, geometry: ModelGeometry, par, with_shared: bool = False):
        super().__init__()
        intermediate = geometry.moe_intermediate_size
        divide(intermediate, par.tp_size, "the experts' intermediate size")
        features = ShardPart(intermediate)
        rank_features = features.rank_size(par.tp_rank, par.tp_size)
        shared_slot = geometry.num_experts if with_shared else None
        num_experts, hidden = geometry.num_experts + with_shared, geometry.hidden_size
        self.scale_block = None
        dtype = par.dtype
        if geometry.fp8_experts:
            block = geometry.quantization.block_size[0]
            if par.tp_size > 1 and intermediate % (block * par.tp_size):
                raise UnsupportedQuantizationError(
                    f"the experts' intermediate size {intermediate} split over tensor parallel size {par.tp_size} "
                    f"would split their {block}-row FP8 scale blocks; use a tensor parallel size that divides "
                    f"{intermediate // block if intermediate % block == 0 else 1}"
                )
            self.scale_block = block
            dtype = torch.float8_e4m3fn
        gate_up = (("gate_proj", 0, 1), ("up_proj", 1, 1))
        self.gate_up_proj = _expert_stack((num_experts, 2 * rank_features, hidden), dtype, par, 1,
                                          (features, features), gate_up, "weight", shared_slot)
        self.down_proj = _expert_stack((num_experts, hidden, rank_features), dtype, par, 2, (features,),
                                       (("down_proj", 0, 1),), "weight", shared_slot)
        if self.scale_block is None:
            self.gate_up_proj_scale_inv = self.down_proj_scale_inv = None
            return
        blocks = lambda size: -(-size // self.scale_block)  # noqa: E731
        scale_rows = ShardPart(blocks(intermediate))
        rank_rows = scale_rows.rank_size(par.tp_rank, par.tp_size)
        self.gate_up_proj_scale_inv = _expert_stack((num_experts, 2 * rank_rows, blocks(hidden)), torch.float32, par,
                                                    1, (scale_rows, scale_rows), gate_up, "weight_scale_inv",
                                                    shared_slot)
        self.down_proj_scale_inv = _expert_stack((num_experts, blocks(hidden), rank_rows), torch.float32, par, 2,
                                                 (scale_rows,), (("down_proj", 0, 1),), "weight_scale_inv",
                                                 shared_slot)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and the gated shared expert: stacked with the routed ones when `shared_expert` is None
    (`ModelGeometry.shared_expert_in_stack`), else `shared_expert`, a SwiGLU MLP built by the caller."""

    def __init__(self, geometry: ModelGeometry, par, shared_expert: nn.Module | None):
        super().__init__()
        self.top_k = geometry.num_experts_per_tok
        self.renormalise = geometry.norm_topk_prob or geometry.model_type in ALWAYS_RENORMALISED_MODEL_TYPES
        self.tp_size = par.tp_size
        self.router = RouterWeight(geometry.num_experts, geometry.hidden_size, par)
        self.experts = StackedExperts(geometry, par, with_shared=shared_expert is None)
        self.shared_expert = shared_expert

    def prefetched(self) -> tuple[torch.Tensor, ...]:
        """What the kernel before the block asks the L2 cache for: what every token reads, the router and the shared
        expert (the routed experts are not known until the router has run)."""
        if self.shared_expert is not None:
            return (self.router.weight, *projection_tensors(self.shared_expert))
        return (self.router.weight, self.experts.gate_up_proj[-1], self.experts.down_proj[-1])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = kernels.linear(hidden, self.router.weight)  # the experts' scores, then the shared expert's gate
        experts = self.experts
        scales = {} if experts.scale_block is None else {
            "w13_scale": experts.gate_up_proj_scale_inv, "w2_scale": experts.down_proj_scale_inv,
            "scale_block": experts.scale_block}
        shared = self.shared_expert
        if shared is None:  # the shared expert is the stack's last, each token's last choice
            moe = kernels.routed_moe(hidden, logits, experts.gate_up_proj, experts.down_proj, self.top_k,
                                     self.renormalise, shared_expert=True, **scales)
            return all_reduce(moe, self.tp_size)
        weights, expert_ids = kernels.moe_route(logits[:, :-1], self.top_k, self.renormalise)
        # The shared expert's down projection without its own all-reduce: one all-reduce sums both partials, which
        # the fused kernel adds (routed + sigmoid(gate) * shared) in its final reduction.
        shared_partial = shared.down_proj.partial(shared.act(shared.gate_up_proj(hidden)))
        moe = kernels.fused_moe(hidden, experts.gate_up_proj, experts.down_proj, weights, expert_ids, **scales,
                                shared_gate=logits[:, -1:], shared=shared_partial)
        return all_reduce(moe, self.tp_size)
