"""Plain-torch reference of the fused mixture-of-experts feed-forward, with the dispatcher's signature.

Each (token, choice) pair runs its expert's SwiGLU: `down_e(silu(gate_e x) * up_e x)`, scaled by its routing weight and
summed over the token's choices. Experts run grouped (every token routed to an expert in one matmul), in float32
(float64 for float64 activations); the SiLU product is rounded to the activation dtype before the down projection,
as the Triton kernel stores it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import compute_dtype


def moe_route(router_logits, top_k: int, renormalise: bool, shared_expert: bool = False):
    """(weights `[T, k]` in the logits' dtype, expert ids `[T, k]` int64) of each token's k most probable experts,
    most probable first: a float32 softmax over `router_logits` `[T, E]`, its top k, renormalised to sum to one
    when `renormalise`, then cast (transformers' Qwen3.5-MoE and Qwen3-Next routers).

    With `shared_expert`, the logits' last column is the shared expert's gate logit (`[T, E + 1]`: the router and the
    gate as one projection) and each token gets one more choice, expert E weighted by the gate's sigmoid in the logits'
    dtype, `[T, k + 1]`: the shared expert run as one more expert of the stack."""
    check_route_shapes(router_logits, top_k, shared_expert)
    scores = router_logits[:, :-1] if shared_expert else router_logits
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(router_logits.dtype)
    if not shared_expert:
        return weights, expert_ids
    gate = torch.sigmoid(router_logits[:, -1:])
    shared_ids = torch.full_like(expert_ids[:, :1], scores.shape[1])
    return torch.cat([weights, gate], dim=1), torch.cat([expert_ids, shared_ids], dim=1)


def check_route_shapes(router_logits, top_k: int, shared_expert: bool = False) -> None:
    experts = (router_logits.shape[-1] if router_logits.dim() else 0) - shared_expert
    if router_logits.dim() != 2 or not 1 <= top_k <= experts:
        shape = "[tokens, experts + 1 (the shared expert's gate)]" if shared_expert else "[tokens, experts]"
        raise ValueError(f"router_logits must be {shape} with top_k in [1, experts], got "
                         f"{tuple(router_logits.shape)} and top_k {top_k}")


def check_shared_shapes(hidden, shared_gate, shared) -> None:
    if (shared_gate is None) != (shared is None):
        raise ValueError("shared_gate and shared come together (a gated shared expert) or not at all")
    if shared is not None and (tuple(shared.shape) != tuple(hidden.shape)
                               or tuple(shared_gate.shape) != (hidden.shape[0], 1)):
        raise ValueError(f"shared {tuple(shared.shape)} and shared_gate {tuple(shared_gate.shape)} must be "
                         f"{tuple(hidden.shape)} and [{hidden.shape[0]}, 1]")


def add_shared_expert(routed, shared_gate, shared):
    """`routed + sigmoid(shared_gate) * shared` in the activation dtype, as transformers computes it (the Triton
    kernel adds it in float32 inside its final reduction and rounds once, so it differs by an ulp here and there)."""
    if shared is None:
        return routed
    return routed + torch.sigmoid(shared_gate) * shared


def check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None,
                     scale_block: int = 128) -> None:
    num_experts, double_intermediate, hidden_size = w13.shape
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden must be [tokens, {hidden_size}], got {tuple(hidden.shape)}")
    if double_intermediate % 2 or tuple(w2.shape) != (num_experts, hidden_size, double_intermediate // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H] and [E, H, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [tokens={hidden.shape[0]}, k]")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("w13_scale and w2_scale come together (e4m3 experts) or not at all")
    if w13_scale is None:
        return
    blocks = lambda size: -(-size // scale_block)  # noqa: E731
    intermediate = double_intermediate // 2
    want13 = (num_experts, 2 * blocks(intermediate), blocks(hidden_size))
    want2 = (num_experts, blocks(hidden_size), blocks(intermediate))
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(f"w13_scale {tuple(w13_scale.shape)} and w2_scale {tuple(w2_scale.shape)} must be {want13} "
                         f"(gate blocks, then up blocks) and {want2} for {scale_block}-square blocks")


def dequantize_experts(w13, w2, w13_scale, w2_scale, scale_block: int = 128):
    """The float32 stacks of e4m3 experts: each checkpoint projection (gate, up, down) times its own block grid."""
    from .quant_reference import dequantize_fp8_block

    block = (scale_block, scale_block)
    intermediate = w13.shape[1] // 2
    gate_blocks = -(-intermediate // scale_block)
    w13_dense = torch.stack([torch.cat([
        dequantize_fp8_block(w13[e, :intermediate], w13_scale[e, :gate_blocks], block),
        dequantize_fp8_block(w13[e, intermediate:], w13_scale[e, gate_blocks:], block),
    ]) for e in range(w13.shape[0])])
    w2_dense = torch.stack([dequantize_fp8_block(w2[e], w2_scale[e], block) for e in range(w2.shape[0])])
    return w13_dense, w2_dense


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, scale_block: int = 128,
              shared_gate=None, shared=None):
    """hidden `[T, H]`, w13 `[E, 2I, H]` (gate rows then up rows), w2 `[E, H, I]`, topk_weights `[T, k]`, topk_ids
    `[T, k]` -> `[T, H]` in hidden's dtype: sum over j of topk_weights[t, j] * expert topk_ids[t, j] applied to x_t,
    plus, with a gated shared expert's output `shared` `[T, H]` and gate logits `shared_gate` `[T, 1]`,
    `sigmoid(shared_gate) * shared` (`add_shared_expert`).

    e4m3 experts carry `weight_scale_inv` grids per `scale_block`-square block: w13_scale `[E, 2 ceil(I/B),
    ceil(H/B)]` (the gate projection's blocks, then the up projection's, as their checkpoint tensors store them) and
    w2_scale `[E, ceil(H/B), ceil(I/B)]`; the experts are `weight * weight_scale_inv` per block."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, scale_block)
    check_shared_shapes(hidden, shared_gate, shared)
    if w13_scale is not None:
        w13, w2 = dequantize_experts(w13, w2, w13_scale, w2_scale, scale_block)
    dtype = compute_dtype(hidden.dtype)
    num_tokens, top_k = topk_ids.shape
    x = hidden.to(dtype)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=dtype, device=hidden.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).to(dtype)
    choices = torch.argsort(flat_ids, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = choices[start : start + count]
        start += count
        tokens = rows // top_k
        gate, up = (x[tokens] @ w13[expert].to(dtype).T).chunk(2, dim=-1)
        product = (F.silu(gate) * up).to(hidden.dtype).to(dtype)
        out.index_add_(0, tokens, (product @ w2[expert].to(dtype).T) * flat_weights[rows, None])
    return add_shared_expert(out.to(hidden.dtype), shared_gate, shared)


def routed_moe(hidden, router_logits, w13, w2, top_k: int, renormalise: bool, shared_expert: bool = False,
               w13_scale=None, w2_scale=None, scale_block: int = 128):
    """`fused_moe` of the choices `moe_route` makes from `router_logits`: the Triton version routes a single token
    inside its gate/up kernel, this is the definition."""
    weights, ids = moe_route(router_logits, top_k, renormalise, shared_expert)
    return fused_moe(hidden, w13, w2, weights, ids, w13_scale, w2_scale, scale_block)
