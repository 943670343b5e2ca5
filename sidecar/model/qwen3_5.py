"""Qwen3.5 / Qwen3.6 text stacks, dense and MoE, and Qwen3-Next: Gated DeltaNet layers, gated full-attention layers,
SwiGLU MLPs or sparse mixture-of-experts blocks (`moe.py`).

The model reads a `BatchContext` and the caches bound to it; it knows nothing of requests. A step is a flat batch of
T tokens: the first `ctx.num_decodes` sequences are one-token decodes, the rest are prefill chunks. GDN layers keep
their conv and recurrent state in slot-indexed pools (a new request's slot is zero, so its first chunk starts from
an empty state); full-attention layers write K/V into the paged token pool and attend over the block tables.

The math follows Hugging Face transformers' `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` and `Qwen3NextForCausalLM`
exactly (the test suite compares logits); Qwen3-Next differs only in how its checkpoints store the GDN projections
(`qwen3_next.py`). Parameter
names follow the checkpoint's, except merged projections (one GEMM each): `in_proj_qkvzba` = [in_proj_qkv | in_proj_z |
in_proj_b | in_proj_a], `qkv_proj` = [q_proj | k_proj | v_proj], `gate_up_proj` = [gate_proj | up_proj];
`PACKED_CHECKPOINT_NAMES` maps them back. The forward pass never reads a device tensor on the host, so decode steps
can be captured in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridkv import kernels
from hybridkv.errors import UserError
from hybridkv.sidecar.model.context import BatchContext
from hybridkv.sidecar.model.moe import SparseMoeBlock
from hybridkv.sidecar.model.qwen3_next import read_key_head_grouped, read_quantized_key_head_grouped
from hybridkv.sidecar.model.quantized import fp8_input_group, quantize_linears
from hybridkv.sidecar.model.layers import (
    GatedRMSNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    ShardPart,
    SiluAndMul,
    VocabParallelEmbedding,
    all_reduce,
    divide,
    projection_tensors,
    sharded_parameter,
)
from hybridkv.sizing import ModelGeometry, check_tensor_parallel_size
from hybridkv.sizing.quantization import FP8

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")

# Merged parameter -> the checkpoint tensors it is made of, in output order, with how many shard parts each holds.
PACKED_CHECKPOINT_NAMES: dict[str, tuple[tuple[str, int], ...]] = {
    "in_proj_qkvzba": (("in_proj_qkv", 3), ("in_proj_z", 1), ("in_proj_b", 1), ("in_proj_a", 1)),
    "qkv_proj": (("q_proj", 1), ("k_proj", 1), ("v_proj", 1)),
    "gate_up_proj": (("gate_proj", 1), ("up_proj", 1)),
}
# Qwen3-Next's checkpoints fuse the GDN input projections (grouped by key head, `qwen3_next`); a quantized model holds
# them as these two checkpoint projections.
QWEN3_NEXT_PACKED_NAMES = {"in_proj_qkvzba": (("in_proj_qkvz", 4), ("in_proj_ba", 2))}


class UnsupportedModelError(UserError):
    """A model architecture the engine cannot run."""


def check_supported(geometry: ModelGeometry) -> None:
    """Reject geometries this model code does not implement, before any memory is allocated."""
    what = geometry.name or geometry.model_type
    if geometry.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{what}: {geometry.model_type} is not supported by the engine yet; it serves model types "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if geometry.model_type == "qwen3_5_moe_text" and not geometry.norm_topk_prob:
        raise UnsupportedModelError(
            f"{what}: norm_topk_prob=false is not supported for qwen3_5_moe_text, whose router always renormalises "
            "its top-k weights; remove the key"
        )
    _check_quantized_layers(geometry, what)
    if geometry.attention_bias or geometry.hidden_act != "silu":
        raise UnsupportedModelError(
            f"{what}: attention_bias={geometry.attention_bias}, hidden_act={geometry.hidden_act!r} is not supported "
            f"by the engine yet; Qwen3.5/Qwen3.6 use attention_bias=false and hidden_act='silu'"
        )


def _check_quantized_layers(geometry: ModelGeometry, what: str) -> None:
    """The quantized GEMMs serve the attention, Gated DeltaNet and dense MLP projections of Qwen3.5/3.6, and the fused
    MoE kernel block-scaled e4m3 experts; 4-bit experts and Qwen3-Next's merged GDN projections have no quantized
    form here."""
    quantization = geometry.quantization
    if quantization is None:
        return
    if geometry.model_type == "qwen3_next":
        block = quantization.block_size[0] if quantization.method == FP8 else 0
        if not block or geometry.linear_key_head_dim % block or geometry.linear_value_head_dim % block:
            raise UnsupportedModelError(
                f"{what}: quantized qwen3_next checkpoints are served in FP8 with GDN head dims that are multiples "
                f"of its {block or 128}-row blocks (their rows are regrouped by key head at load); this one is "
                f"{quantization.method} with key/value head dims {geometry.linear_key_head_dim}/"
                f"{geometry.linear_value_head_dim}, which is not served yet; serve the 16-bit or an FP8 checkpoint"
            )
    if geometry.is_moe and geometry.sparse_layer_ids and quantization.method != FP8:
        expert = f"model.layers.{geometry.sparse_layer_ids[0]}.mlp.experts.0.gate_proj"
        if quantization.converts(expert):
            raise UnsupportedModelError(
                f"{what}: {quantization.method} MoE experts (from {expert}) are not served yet: the fused MoE "
                "kernel takes 16-bit or FP8 experts; serve the 16-bit or an FP8 checkpoint, or one whose "
                "quantization_config keeps mlp.experts in modules_to_not_convert"
            )


@dataclass(frozen=True)
class _Parallel:
    dtype: torch.dtype
    device: torch.device
    tp_rank: int
    tp_size: int
    quantized: bool = False

    def kwargs(self) -> dict:
        return {"dtype": self.dtype, "device": self.device, "tp_rank": self.tp_rank, "tp_size": self.tp_size}

    def linear_kwargs(self) -> dict:
        # Quantized checkpoints: projections start on the meta device and `quantize_linears` gives them storage.
        return {**self.kwargs(), "device": torch.device("meta")} if self.quantized else self.kwargs()


class CausalConv1dWeight(nn.Module):
    """The depthwise conv weight `[conv_dim, 1, W]`, split by channels like the q|k|v projection it follows."""

    def __init__(self, channel_parts: list[ShardPart], kernel_size: int, par: _Parallel):
        super().__init__()
        channels = sum(part.rank_size(par.tp_rank, par.tp_size) for part in channel_parts)
        self.weight = sharded_parameter((channels, 1, kernel_size), par.dtype, par.device, 0, channel_parts,
                                        par.tp_rank, par.tp_size)


class Qwen3_5GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer: projections, causal conv + SiLU, gated delta rule, gated RMSNorm, out projection."""

    def __init__(self, geometry: ModelGeometry, par: _Parallel):
        super().__init__()
        self.num_k_heads = divide(geometry.linear_num_key_heads, par.tp_size, "the GDN key heads")
        self.num_v_heads = divide(geometry.linear_num_value_heads, par.tp_size, "the GDN value heads")
        self.head_k_dim = geometry.linear_key_head_dim
        self.head_v_dim = geometry.linear_value_head_dim
        self.conv_kernel_size = geometry.linear_conv_kernel_dim
        k_heads = ShardPart(geometry.linear_num_key_heads, self.head_k_dim)
        v_heads = ShardPart(geometry.linear_num_value_heads, self.head_v_dim)
        gates = ShardPart(geometry.linear_num_value_heads)
        self.in_proj_qkvzba = MergedColumnParallelLinear(
            geometry.hidden_size, [k_heads, k_heads, v_heads, v_heads, gates, gates], **par.linear_kwargs()
        )
        if geometry.model_type == "qwen3_next":
            read_key_head_grouped(self.in_proj_qkvzba.weight, geometry.linear_num_key_heads)
        self.conv1d = CausalConv1dWeight([k_heads, k_heads, v_heads], self.conv_kernel_size, par)
        self.conv_dim = self.conv1d.weight.shape[0]
        # Kept in the model dtype as transformers keeps them (the kernels upcast to fp32), so the weight bytes are
        # exactly what the planner counts.
        self.A_log = sharded_parameter((self.num_v_heads,), par.dtype, par.device, 0, [gates], par.tp_rank,
                                       par.tp_size)
        self.dt_bias = sharded_parameter((self.num_v_heads,), par.dtype, par.device, 0, [gates], par.tp_rank,
                                         par.tp_size)
        self.norm = GatedRMSNorm(self.head_v_dim, geometry.rms_norm_eps, dtype=par.dtype, device=par.device)
        self.out_proj = RowParallelLinear(v_heads, geometry.hidden_size, **par.linear_kwargs())
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        # The prefix cache's checkpoint pools of this layer (same layouts), which in-chunk captures write.
        self.checkpoint_conv: torch.Tensor | None = None
        self.checkpoint_ssm: torch.Tensor | None = None

    # A step runs each token mixer in three parts: `project` and `finish` are the token-wise work before and after
    # `mix`, the part that reads the step's sequences (their caches and layout). Mixed steps replayed as CUDA graphs
    # run the parts apart (`sidecar/execution/piecewise.py`); `forward` runs them in a row.
    def project(self, positions: torch.Tensor | None, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.in_proj_qkvzba(hidden),)

    def prefetched(self) -> tuple[torch.Tensor, ...]:
        """What the kernel before `project` asks the L2 cache for (`kernels.rms_norm`'s `prefetch`)."""
        return projection_tensors(self.in_proj_qkvzba)

    def core_shape(self, num_tokens: int) -> tuple[int, int, int]:
        """The shape of `mix`'s output for a step of `num_tokens` tokens."""
        return (num_tokens, self.num_v_heads, self.head_v_dim)

    def mix(self, projected: tuple[torch.Tensor, ...], ctx: BatchContext,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal conv + SiLU and the gated delta rule of the step's decode rows and prefill chunks, written into
        `out` (`core_shape`) when given."""
        (mixed,) = projected
        num_tokens = mixed.shape[0]
        qkv, _, b, a = self._split(mixed)
        conv_weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel_size)
        heads = (self.num_k_heads, self.head_k_dim, self.head_v_dim)
        num_decodes = ctx.num_decodes
        outputs = []
        if num_decodes:
            slots = ctx.decode_slot_ids
            # Each state is read before its kernel waits for the kernels before it (the projection, then the
            # conv), none of which writes it: only this layer's own decode kernels do, once a step.
            conv = kernels.causal_conv1d_decode(qkv[:num_decodes], conv_weight, self.conv_state, slots,
                                                prefetch_state=True)
            outputs.append(kernels.gdn_decode(conv, a[:num_decodes], b[:num_decodes], self.A_log, self.dt_bias,
                                              self.ssm_state, slots, *heads, prefetch_state=True))
        if num_tokens > num_decodes:
            capture = None
            if ctx.state_captures is not None:
                captures = ctx.state_captures
                # The conv state at a capture point is the raw inputs before it, rows of this chunk (gathered with
                # index_select: a tensor subscript costs the host about three times as much per layer).
                rows = captures.conv_rows
                history = qkv[num_decodes:].index_select(0, rows.reshape(-1)).view(*rows.shape, -1)
                self.checkpoint_conv.index_copy_(0, captures.conv_slots,
                                                 history.transpose(1, 2).to(self.checkpoint_conv.dtype))
                capture = (captures.chunk_slots, self.checkpoint_ssm)
            outputs.append(kernels.conv_gdn_prefill(
                qkv[num_decodes:], conv_weight, self.conv_state, a[num_decodes:], b[num_decodes:], self.A_log,
                self.dt_bias, self.ssm_state, ctx.prefill_slot_ids, ctx.prefill_cu_seqlens, *heads,
                cu_seqlens_cpu=ctx.prefill_cu_seqlens_cpu, capture=capture, null_slots=ctx.prefill_on_null_slot,
            ))
        return _gather_rows(outputs, out)

    def finish(self, projected: tuple[torch.Tensor, ...], core: torch.Tensor) -> torch.Tensor:
        (mixed,) = projected
        num_tokens = mixed.shape[0]
        z = self._split(mixed)[1].view(num_tokens, self.num_v_heads, self.head_v_dim)
        if isinstance(self.out_proj, RowParallelLinear):
            # One token's gated norm is read by its projection's GEMV as it multiplies (`kernels.gated_norm_linear`).
            out = kernels.gated_norm_linear(core, z, self.norm.weight, self.norm.eps, self.out_proj.weight)
            return all_reduce(out, self.out_proj.tp_size)
        return self.out_proj(self.norm(core, z).reshape(num_tokens, -1))

    def forward(self, hidden: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        projected = self.project(None, hidden)
        return self.finish(projected, self.mix(projected, ctx))

    def _split(self, mixed: torch.Tensor) -> list[torch.Tensor]:
        """[qkv | z | b | a] of the merged input projection."""
        return mixed.split([self.conv_dim, self.num_v_heads * self.head_v_dim, self.num_v_heads, self.num_v_heads],
                           dim=-1)


def _gather_rows(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """The parts' rows back to back: into `out` when given, else the one part itself or their concatenation."""
    if out is None:
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    row = 0
    for part in parts:
        out[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]
    return out


class Qwen3_5Attention(nn.Module):
    """Full attention with per-head q/k RMSNorm, partial NeoX rotary and a sigmoid output gate, over paged K/V."""

    def __init__(self, geometry: ModelGeometry, par: _Parallel):
        super().__init__()
        self.head_dim = geometry.head_dim
        self.num_heads = divide(geometry.num_attention_heads, par.tp_size, "the attention query heads")
        self.num_kv_heads = max(1, geometry.num_key_value_heads // par.tp_size)
        self.output_gate = bool(geometry.attn_output_gate)
        # The gate is interleaved per head in q_proj: [q_h0 | gate_h0 | q_h1 | gate_h1 ...], so heads shard whole.
        q_part = ShardPart(geometry.num_attention_heads, self.head_dim * (2 if self.output_gate else 1))
        kv_part = ShardPart(geometry.num_key_value_heads, self.head_dim)
        self.qkv_proj = MergedColumnParallelLinear(geometry.hidden_size, [q_part, kv_part, kv_part], **par.linear_kwargs())
        self.o_proj = RowParallelLinear(ShardPart(geometry.num_attention_heads, self.head_dim), geometry.hidden_size,
                                        **par.linear_kwargs())
        self.q_norm = RMSNorm(self.head_dim, geometry.rms_norm_eps, dtype=par.dtype, device=par.device)
        self.k_norm = RMSNorm(self.head_dim, geometry.rms_norm_eps, dtype=par.dtype, device=par.device)
        rotary_dim = int(self.head_dim * geometry.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rotary_dim, geometry.rope_theta, device=par.device)
        self.scale = self.head_dim**-0.5
        # Static fp8 KV-cache scales: the checkpoint's (the loader sets them), else 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    # The three parts of a step as for Gated DeltaNet: projections, q/k norms and rotary; the paged K/V write and
    # attention; the output gate and projection.
    def project(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        # The q and k norms and the rotary after them run as one kernel.
        q, k = kernels.qk_norm_rotary(q.reshape(num_tokens, self.num_heads, self.head_dim),
                                      k.view(num_tokens, self.num_kv_heads, self.head_dim), self.q_norm.weight,
                                      self.k_norm.weight, self.q_norm.eps, positions, self.rotary.inv_freq,
                                      self.rotary.rotary_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return (q, k, v) if gate is None else (q, k, v, gate)

    def prefetched(self) -> tuple[torch.Tensor, ...]:
        return projection_tensors(self.qkv_proj)

    def core_shape(self, num_tokens: int) -> tuple[int, int, int]:
        return (num_tokens, self.num_heads, self.head_dim)

    def mix(self, projected: tuple[torch.Tensor, ...], ctx: BatchContext,
            out: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = projected[:3]
        # The scales apply to an fp8 pool only: a 16/32-bit pool keeps K and V as computed, as vLLM does.
        scales = (self.k_scale, self.v_scale) if self.k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)
        kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, *scales)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for rows in ctx.attention_parts:  # decode rows and prefill chunks launch apart (BatchContext)
            kernels.paged_attention(q[rows.first : rows.end], self.k_cache, self.v_cache, rows.block_tables,
                                    rows.cu_seqlens_q, rows.seq_lens, self.scale, rows.max_seqlen_q,
                                    rows.max_seqlen_k, *scales, out=out[rows.first : rows.end])
        return out

    def finish(self, projected: tuple[torch.Tensor, ...], core: torch.Tensor) -> torch.Tensor:
        if self.output_gate and isinstance(self.o_proj, RowParallelLinear):
            # One token's gate is read by its projection's GEMV as it multiplies (`kernels.sigmoid_gated_linear`).
            return all_reduce(kernels.sigmoid_gated_linear(core, projected[3], self.o_proj.weight),
                              self.o_proj.tp_size)
        if self.output_gate:
            core = core * torch.sigmoid(projected[3])
        return self.o_proj(core.reshape(core.shape[0], -1))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        projected = self.project(positions, hidden)
        return self.finish(projected, self.mix(projected, ctx))


class Qwen3_5MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, par: _Parallel):
        super().__init__()
        divide(intermediate_size, par.tp_size, "the MLP intermediate size")
        features = ShardPart(intermediate_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [features, features], **par.linear_kwargs())
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(features, hidden_size, **par.linear_kwargs())

    def prefetched(self) -> tuple[torch.Tensor, ...]:
        return projection_tensors(self.gate_up_proj, self.down_proj)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        if isinstance(self.down_proj, RowParallelLinear):
            # One token's SwiGLU is read by the down projection's GEMV as it multiplies (`kernels.swiglu_linear`).
            return all_reduce(kernels.swiglu_linear(gate_up, self.down_proj.weight), self.down_proj.tp_size)
        return self.down_proj(self.act(gate_up))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, geometry: ModelGeometry, layer_id: int, par: _Parallel):
        super().__init__()
        self.layer_type = layer_type = geometry.layer_types[layer_id]
        if layer_type == "linear_attention":
            self.linear_attn = Qwen3_5GatedDeltaNet(geometry, par)
        else:
            self.self_attn = Qwen3_5Attention(geometry, par)
        if layer_id in geometry.sparse_layer_ids:
            shared = (None if geometry.shared_expert_in_stack
                      else Qwen3_5MLP(geometry.hidden_size, geometry.shared_expert_intermediate_size, par))
            self.mlp = SparseMoeBlock(geometry, par, shared)
        else:
            self.mlp = Qwen3_5MLP(geometry.hidden_size, geometry.intermediate_size, par)
        self.input_layernorm = RMSNorm(geometry.hidden_size, geometry.rms_norm_eps, dtype=par.dtype,
                                       device=par.device)
        self.post_attention_layernorm = RMSNorm(geometry.hidden_size, geometry.rms_norm_eps, dtype=par.dtype,
                                                device=par.device)

    @property
    def mixer(self) -> "Qwen3_5GatedDeltaNet | Qwen3_5Attention":
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn


class Qwen3_5TextModel(nn.Module):
    """The decoder stack. A step runs as `num_pieces` token-wise pieces with one layer's `mix` between each two:
    piece 0 embeds and projects layer 0's mixer inputs; piece i finishes layer i-1 (its mixer's output part and its
    MLP) and projects layer i's; the last piece ends with the final norm. A piece returns `(residual, *projected)`
    for the next (the last returns `(hidden,)`), which takes it with the mixer's output appended."""

    def __init__(self, geometry: ModelGeometry, par: _Parallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(geometry.vocab_size, geometry.hidden_size, **par.kwargs())
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(geometry, layer_id, par) for layer_id in range(geometry.num_hidden_layers)
        )
        self.norm = RMSNorm(geometry.hidden_size, geometry.rms_norm_eps, dtype=par.dtype, device=par.device)

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def piece(self, index: int, input_ids: torch.Tensor, positions: torch.Tensor,
              carry: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if index == 0:
            residual = self.embed_tokens(input_ids)
            hidden = self.layers[0].input_layernorm(residual)
        else:
            residual, *projected, core = carry
            layer = self.layers[index - 1]
            hidden = layer.mixer.finish(projected, core)
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = layer.mlp(hidden)
            if index == len(self.layers):
                return (self.norm(hidden, residual)[0],)
            hidden, residual = self.layers[index].input_layernorm(hidden, residual)
        return (residual, *self.layers[index].mixer.project(positions, hidden))

    def forward(self, input_ids, positions, ctx: BatchContext) -> torch.Tensor:
        carry = self.piece(0, input_ids, positions, ())
        for index, layer in enumerate(self.layers):
            core = layer.mixer.mix(carry[1:], ctx)
            if ctx.between_layers is not None:
                ctx.between_layers()
            carry = self.piece(index + 1, input_ids, positions, (*carry, core))
        return carry[0]


def _prefetch_before_projections(model: Qwen3_5TextModel) -> None:
    """Hands each layer norm the weights of the projection after it (`prefetched`), which it asks the L2 cache for
    at decode sizes; run once the projections are final (quantization replaces them)."""
    for layer in model.layers:
        layer.input_layernorm.prefetch = layer.mixer.prefetched()
        layer.post_attention_layernorm.prefetch = layer.mlp.prefetched()


def _quantize_before_fp8_projections(model: nn.Module) -> None:
    """The norms and SwiGLU activations whose outputs only FP8 projections read write them quantized too, so those
    GEMMs launch no quantization of their own: each layer's input norm (its token mixer's input projection), the
    post-attention norm before a dense MLP (an MoE block's router reads its input in 16 bits) and every SwiGLU
    before its down projection."""
    for layer in model.layers:
        mixer = layer.linear_attn.in_proj_qkvzba if layer.layer_type == "linear_attention" else layer.self_attn.qkv_proj
        layer.input_layernorm.fp8_group = fp8_input_group(mixer)
        if isinstance(layer.mlp, Qwen3_5MLP):
            layer.post_attention_layernorm.fp8_group = fp8_input_group(layer.mlp.gate_up_proj)
    for module in model.modules():
        if isinstance(module, Qwen3_5MLP):
            module.act.fp8_group = fp8_input_group(module.down_proj)


class Qwen3_5ForCausalLM(nn.Module):
    """The text model of one tensor-parallel rank; weights are uninitialised until `load_checkpoint` fills them."""

    def __init__(self, geometry: ModelGeometry, dtype: torch.dtype, device: torch.device | str, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__()
        check_supported(geometry)
        check_tensor_parallel_size(geometry, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
        self.geometry = geometry
        self.dtype = dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        par = _Parallel(dtype, torch.device(device), tp_rank, tp_size, quantized=geometry.quantization is not None)
        self.model = Qwen3_5TextModel(geometry, par)
        if geometry.quantization is not None:
            next_model = geometry.model_type == "qwen3_next"
            packed = {**PACKED_CHECKPOINT_NAMES, **QWEN3_NEXT_PACKED_NAMES} if next_model else PACKED_CHECKPOINT_NAMES
            quantize_linears(self.model, geometry.quantization, packed, dtype, par.device)
            if next_model:
                read_quantized_key_head_grouped(self.model, geometry.linear_num_key_heads)
            _quantize_before_fp8_projections(self.model)
        _prefetch_before_projections(self.model)
        tied = geometry.tie_word_embeddings
        # A tied head is the embedding: built on the meta device so its own weight is never allocated.
        self.lm_head = ParallelLMHead(geometry.vocab_size, geometry.hidden_size, dtype=dtype,
                                      device="meta" if tied else par.device, tp_rank=tp_rank, tp_size=tp_size)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gdn_layers = [layer.linear_attn for layer in self.model.layers if layer.layer_type == "linear_attention"]
        self.attention_layers = [layer.self_attn for layer in self.model.layers if layer.layer_type != "linear_attention"]

    # Cache geometry of this rank, for whoever allocates the pools.
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one full-attention layer's k_cache (and v_cache) on this rank, null block included."""
        attention = self.attention_layers[0]
        return (num_blocks, block_size, attention.num_kv_heads, attention.head_dim)

    def state_cache_shapes(self, num_slots: int) -> tuple[tuple[int, int, int], tuple[int, int, int, int]]:
        """Shapes of one GDN layer's (conv_state, ssm_state) on this rank, null slot included."""
        gdn = self.gdn_layers[0]
        return ((num_slots, gdn.conv_dim, gdn.conv_kernel_size - 1),
                (num_slots, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim))

    def bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    state_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    checkpoint_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Attach the pools: (k_cache, v_cache) per full-attention layer, (conv_state, ssm_state) per GDN layer, and
        with prefix caching each GDN layer's checkpoint pool (its slots laid out as a state slot)."""
        checkpoint_caches = checkpoint_caches or []
        if len(kv_caches) != len(self.attention_layers) or len(state_caches) != len(self.gdn_layers) or (
                checkpoint_caches and len(checkpoint_caches) != len(self.gdn_layers)):
            raise ValueError(
                f"expected {len(self.attention_layers)} KV caches and {len(self.gdn_layers)} state (and checkpoint) "
                f"caches, got {len(kv_caches)}, {len(state_caches)} and {len(checkpoint_caches)}"
            )
        for attention, (k_cache, v_cache) in zip(self.attention_layers, kv_caches):
            expected = self.kv_cache_shape(k_cache.shape[0], k_cache.shape[1])
            if tuple(k_cache.shape) != expected or tuple(v_cache.shape) != expected:
                raise ValueError(f"KV cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)}; expected {expected}")
            attention.k_cache, attention.v_cache = k_cache, v_cache
        for gdn, (conv_state, ssm_state) in zip(self.gdn_layers, state_caches):
            expected = self.state_cache_shapes(conv_state.shape[0])
            if (tuple(conv_state.shape), tuple(ssm_state.shape)) != expected:
                raise ValueError(
                    f"state cache shapes {tuple(conv_state.shape)}, {tuple(ssm_state.shape)}; expected {expected}"
                )
            gdn.conv_state, gdn.ssm_state = conv_state, ssm_state
        for index, gdn in enumerate(self.gdn_layers):
            conv_checkpoints, ssm_checkpoints = checkpoint_caches[index] if checkpoint_caches else (None, None)
            if conv_checkpoints is not None:
                expected = self.state_cache_shapes(conv_checkpoints.shape[0])
                if (tuple(conv_checkpoints.shape), tuple(ssm_checkpoints.shape)) != expected:
                    raise ValueError(f"checkpoint pool shapes {tuple(conv_checkpoints.shape)}, "
                                     f"{tuple(ssm_checkpoints.shape)}; expected {expected}")
            gdn.checkpoint_conv, gdn.checkpoint_ssm = conv_checkpoints, ssm_checkpoints

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits for the given hidden rows, on every rank."""
        return self.lm_head.compute_logits(hidden).float()
