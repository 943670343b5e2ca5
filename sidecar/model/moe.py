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
dimension across ranks; the router and the shared-expert gate are replicated, and the routed and shared partial
sums are all-reduced together, once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv import kernels
from hybridkv.sidecar.model.layers import ShardLayout, ShardPart, all_reduce, divide, sharded_parameter
from hybridkv.sizing import ModelGeometry

# Qwen3.5-MoE's router has no `norm_topk_prob` switch: it always renormalises the top-k probabilities.
ALWAYS_RENORMALISED_MODEL_TYPES = ("qwen3_5_moe_text",)


class ReplicatedWeight(nn.Module):
    """A bias-free projection every rank holds whole (the router, the shared-expert gate)."""

    def __init__(self, out_features: int, in_features: int, par):
        super().__init__()
        self.weight = sharded_parameter((out_features, in_features), par.dtype, par.device)


class StackedExperts(nn.Module):
    """All experts' weights of one layer, this rank's slice of each expert's intermediate features."""

    def __init__(self, geometry: ModelGeometry, par):
        super().__init__()
        divide(geometry.moe_intermediate_size, par.tp_size, "the experts' intermediate size")
        features = ShardPart(geometry.moe_intermediate_size)
        rank_features = features.rank_size(par.tp_rank, par.tp_size)
        num_experts, hidden = geometry.num_experts, geometry.hidden_size
        self.gate_up_proj = sharded_parameter((num_experts, 2 * rank_features, hidden), par.dtype, par.device, 1,
                                              [features, features], par.tp_rank, par.tp_size)
        self.gate_up_proj.expert_parts = (("gate_proj", 0, 1), ("up_proj", 1, 1))
        self.gate_up_proj.expert_layout = ShardLayout(0, (features, features), par.tp_rank, par.tp_size)
        self.down_proj = sharded_parameter((num_experts, hidden, rank_features), par.dtype, par.device, 2,
                                           [features], par.tp_rank, par.tp_size)
        self.down_proj.expert_parts = (("down_proj", 0, 1),)
        self.down_proj.expert_layout = ShardLayout(1, (features,), par.tp_rank, par.tp_size)


def route(router_logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` in the logits' dtype, expert ids `[T, k]`) of each token's top-k experts."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


class SparseMoeBlock(nn.Module):
    """Router, routed experts and the gated shared expert (`shared_expert`, a SwiGLU MLP built by the caller)."""

    def __init__(self, geometry: ModelGeometry, par, shared_expert: nn.Module):
        super().__init__()
        self.top_k = geometry.num_experts_per_tok
        self.renormalise = geometry.norm_topk_prob or geometry.model_type in ALWAYS_RENORMALISED_MODEL_TYPES
        self.tp_size = par.tp_size
        self.gate = ReplicatedWeight(geometry.num_experts, geometry.hidden_size, par)
        self.experts = StackedExperts(geometry, par)
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedWeight(1, geometry.hidden_size, par)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(F.linear(hidden, self.gate.weight), self.top_k, self.renormalise)
        routed = kernels.fused_moe(hidden, self.experts.gate_up_proj, self.experts.down_proj, weights, expert_ids)
        shared = self.shared_expert
        # The shared expert's down projection without its own all-reduce: one all-reduce sums both partials.
        shared_partial = F.linear(shared.act(shared.gate_up_proj(hidden)), shared.down_proj.weight)
        shared_gate = torch.sigmoid(F.linear(hidden, self.shared_expert_gate.weight))
        return all_reduce(routed + shared_gate * shared_partial, self.tp_size)
