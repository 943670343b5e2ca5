"""hybridkv.kernels: Triton kernels for GDN decode/prefill, causal conv1d, paged attention, the model's elementwise
steps (norms, rotary, SwiGLU), fused MoE and the quantized GEMMs, each with a plain-torch reference of the same
signature (`hybridkv.kernels.reference`, `hybridkv.kernels.quant_reference`).

The functions below dispatch: Triton for CUDA tensors, the reference otherwise. `HYBRIDKV_KERNELS=reference` forces
the reference, `HYBRIDKV_KERNELS=triton` forces Triton (on CPU that means the Triton interpreter, where every kernel
but fla's chunk stages inside `gdn_prefill` and `conv_gdn_prefill` runs, so the engine refuses it on CPU). On Hopper
and later the decode chain's kernels (norms, the q/k norms with rotary, SwiGLU, the one-token GEMV, the conv and GDN
decodes, the K/V write, paged attention and its segments' merge) launch dependently, each starting beside the one
before it (`triton_utils.dependent_launch`); `HYBRIDKV_DEPENDENT_LAUNCH=off` launches them in plain order. All but
SwiGLU and the GEMVs of 32 MiB or more let the next kernel start at their own start rather than after their wait
(`triton_utils.early_release`; `HYBRIDKV_EARLY_RELEASE=off` turns that off). At decode sizes the layer norms before
projections of 32 MiB or more also ask the L2 cache for the head of their weights (`triton_utils.l2_prefetch_plan`;
`HYBRIDKV_L2_PREFETCH=off` turns that off). Pool layouts:
conv state `[slots, conv_dim, W-1]`, recurrent state `[slots, HV, V, K]`, `k_cache`/`v_cache`
`[num_blocks, block_size, Hkv, D]` (bf16/fp16/fp32, or float8_e4m3fn with static per-layer K/V scales); slot 0
and block 0 are null and never read or written.
"""

from __future__ import annotations

import importlib
import os

import torch

from hybridkv.errors import UserError

from . import quant_reference, reference

KERNEL_MODES = ("auto", "reference", "triton")


def kernel_mode() -> str:
    """`HYBRIDKV_KERNELS` (default "auto"), refused by name unless one of `KERNEL_MODES`."""
    mode = os.environ.get("HYBRIDKV_KERNELS", "auto")
    if mode not in KERNEL_MODES:
        raise UserError(f"HYBRIDKV_KERNELS={mode!r} is not one of {', '.join(KERNEL_MODES)}; unset it or pick one")
    return mode


def _use_triton(tensor) -> bool:
    mode = kernel_mode()
    return mode == "triton" or (mode == "auto" and tensor.is_cuda)


# Triton modules by name, imported on first use so CPU-only runs never need triton.
_TRITON_MODULES: dict = {}


def _triton_module(module: str):
    found = _TRITON_MODULES.get(module)
    if found is None:
        found = _TRITON_MODULES[module] = importlib.import_module(f"{__name__}.{module}")
    return found


def _impl(module: str, tensor, fallback=reference):
    return _triton_module(module) if _use_triton(tensor) else fallback


def causal_conv1d_prefill(x, weight, conv_state, slot_ids, cu_seqlens):
    """x `[T, D]` (varlen, `cu_seqlens` `[N+1]`) -> SiLU(conv) `[T, D]`; history from and back to the slots."""
    return _impl("conv1d", x).causal_conv1d_prefill(x, weight, conv_state, slot_ids, cu_seqlens)


def causal_conv1d_decode(x, weight, conv_state, slot_ids, prefetch_state: bool = False):
    """x `[B, D]` -> SiLU(conv) `[B, D]`; each row's slot is shifted by one input in place. `prefetch_state`: the
    kernel launched directly before does not write `conv_state`, so a dependently launched kernel reads it before
    waiting for that one (`triton_utils.dependent_launch`)."""
    return _impl("conv1d", x).causal_conv1d_decode(x, weight, conv_state, slot_ids, prefetch_state=prefetch_state)


def gdn_decode(qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, num_k_heads, head_k_dim, head_v_dim,
               prefetch_state: bool = False):
    """One gated delta-rule step per row with fused gating and q/k l2norm; state updated in place -> o `[B, HV, V]`.
    `prefetch_state` as for `causal_conv1d_decode`, of `ssm_state`."""
    return _impl("gdn_recurrent", qkv).gdn_decode(
        qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, num_k_heads, head_k_dim, head_v_dim,
        prefetch_state=prefetch_state,
    )


def gdn_prefill(
    qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
    cu_seqlens_cpu: list[int] | None = None, capture=None,
):
    """Varlen gated delta rule from and back to the slots' states -> o `[T, HV, V]`; new slots must hold zeros.
    `capture` = (chunk_slots int32 `[chunks]`, pool): the state before each 64-token chunk (numbered over all
    sequences in order) whose entry is not -1 is also stored, unrounded, in that slot of `pool`."""
    return _impl("gdn_chunk", qkv).gdn_prefill(
        qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
        cu_seqlens_cpu=cu_seqlens_cpu, capture=capture,
    )


def conv_gdn_prefill(
    x, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
    head_v_dim, cu_seqlens_cpu: list[int] | None = None, capture=None, null_slots: bool = True,
):
    """A GDN layer's varlen prefill from the raw projections x `[T, conv_dim]`: causal conv1d + SiLU, then the gated
    delta rule; the conv and recurrent states come from and go back to each sequence's slot -> o `[T, HV, V]`.
    `capture` as in `gdn_prefill` (the recurrent state only: the conv state at a chunk start is rows of x).
    Rows of sequences on the null slot come out as zeros; `null_slots=False` says there are none (the caller knows
    the slots), which spares the Triton path the launch that zeroes them."""
    if not _use_triton(x):
        return reference.conv_gdn_prefill(
            x, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads,
            head_k_dim, head_v_dim, cu_seqlens_cpu=cu_seqlens_cpu, capture=capture,
        )
    return _triton_module("gdn_chunk").conv_gdn_prefill(
        x, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
        head_v_dim, cu_seqlens_cpu=cu_seqlens_cpu, capture=capture, null_slots=null_slots,
    )


def moe_route(router_logits, top_k: int, renormalise: bool, shared_expert: bool = False):
    """Each token's top-k experts from its router logits `[T, E]`: (weights `[T, k]` in the logits' dtype, ids
    `[T, k]` int64), most probable first (float32 softmax; renormalised to sum to one when `renormalise`). With
    `shared_expert` the logits are `[T, E + 1]`, the last column the shared expert's gate, and each token gets a last
    choice more: expert E weighted by the gate's sigmoid (`moe_reference.moe_route`)."""
    return _impl("moe", router_logits).moe_route(router_logits, top_k, renormalise, shared_expert)


# Output features of the one-token projections the GEMV takes: the LM head (vocabulary-wide, where cuBLAS streams at
# copy rate) stays with cuBLAS, and so do projections too narrow to spread a weight's reads over the GPU (the MoE
# router's 257 outputs are above the line: 2.9 against cuBLAS's 3.1 µs on an H100, four rows a program).
GEMV_MIN_OUT_FEATURES = 256
GEMV_MAX_OUT_FEATURES = 65536


def _gemv_takes(x, weight, in_features: int) -> bool:
    """Whether a one-token projection of `x` (one 16-bit row on the GPU, `in_features` long after any prologue)
    by `weight` runs the GEMV."""
    return (x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.shape[1] == in_features and weight.stride(1) == 1
            and GEMV_MIN_OUT_FEATURES <= weight.shape[0] <= GEMV_MAX_OUT_FEATURES and _use_triton(x))


def linear(x, weight):
    """`F.linear(x, weight)` (no bias). One 16-bit row on the GPU, a batch-1 decode step's projection, runs the
    GEMV (`gemv.gemv`); everything else cuBLAS, or the CPU."""
    if x.dim() == 2 and _gemv_takes(x, weight, x.shape[1]):
        return _triton_module("gemv").gemv(x, weight)
    return torch.nn.functional.linear(x, weight)


def swiglu_linear(gate_up, weight):
    """`linear(silu_and_mul(gate_up), weight)` of a merged `[gate | up]` projection `[T, 2F]`: where `linear` takes
    the GEMV, one GEMV that activates its input as it reads it (`gemv.swiglu_gemv`)."""
    if gate_up.dim() == 2 and _gemv_takes(gate_up, weight, gate_up.shape[1] // 2):
        return _triton_module("gemv").swiglu_gemv(gate_up, weight)
    return linear(silu_and_mul(gate_up), weight)


def gated_norm_linear(core, gate, norm_weight, eps, weight):
    """`linear` of `gated_rms_norm(core, gate, norm_weight, eps)` with its heads `[T, H, D]` flattened: where
    `linear` takes the GEMV, one GEMV that norms and gates its input as it reads it (`gemv.gated_norm_gemv`)."""
    if core.dim() == 3 and _gemv_takes(core, weight, core.shape[1] * core.shape[2]):
        return _triton_module("gemv").gated_norm_gemv(core, gate, norm_weight, eps, weight)
    return linear(gated_rms_norm(core, gate, norm_weight, eps).reshape(core.shape[0], -1), weight)


def sigmoid_gated_linear(core, gate, weight):
    """`linear` of `core * sigmoid(gate)` with its heads `[T, H, D]` flattened: where `linear` takes the GEMV, one
    GEMV that gates its input as it reads it (`gemv.sigmoid_gated_gemv`)."""
    if core.dim() == 3 and _gemv_takes(core, weight, core.shape[1] * core.shape[2]):
        return _triton_module("gemv").sigmoid_gated_gemv(core, gate, weight)
    return linear((core * torch.sigmoid(gate)).reshape(core.shape[0], -1), weight)


def routed_moe(hidden, router_logits, w13, w2, top_k: int, renormalise: bool, shared_expert: bool = False,
               w13_scale=None, w2_scale=None, scale_block: int = 128):
    """`fused_moe` of the choices `moe_route` makes from `router_logits` (`[T, E]`, or `[T, E + 1]` with the
    shared expert's gate last and the shared expert the stack's last, `shared_expert`); one token is routed inside
    the experts' first launch (`moe_reference.routed_moe`)."""
    return _impl("moe", hidden).routed_moe(hidden, router_logits, w13, w2, top_k, renormalise, shared_expert,
                                           w13_scale, w2_scale, scale_block)


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, scale_block: int = 128,
              shared_gate=None, shared=None):
    """Routed experts' SwiGLU of hidden `[T, H]` (w13 `[E, 2I, H]`, w2 `[E, H, I]`), each choice scaled by its
    routing weight and summed over a token's k choices (topk_ids/topk_weights `[T, k]`) -> `[T, H]`; e4m3 experts
    come with their block-scale grids; a gated shared expert's output `shared` `[T, H]` is added scaled by
    `sigmoid(shared_gate)` `[T, 1]` (`moe_reference.fused_moe`)."""
    return _impl("moe", hidden).fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                                          scale_block, shared_gate=shared_gate, shared=shared)


def unpack_decode_inputs(packed, last_tokens, input_ids, positions, slot_mapping, seq_lens, state_slots,
                         sample_slots, block_tables):
    """A decode step packed on the host (`reference.pack_decode_inputs`) into a decode graph's fixed buffers, every
    row of them: pending ids (< 0) from `last_tokens`, rows past the step's padding (`step_inputs`)."""
    return _impl("step_inputs", packed).unpack_decode_inputs(
        packed, last_tokens, input_ids, positions, slot_mapping, seq_lens, state_slots, sample_slots, block_tables)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0):
    """Store k / k_scale and v / v_scale (`[T, Hkv, D]`) at flat slots `slot_mapping` (int64, block * block_size +
    offset); an fp8 pool saturates at ±448."""
    return _impl("attention", k).write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k,
                    k_scale: float = 1.0, v_scale: float = 1.0, out=None):
    """Causal GQA attention of q `[T, Hq, D]` over the paged K/V of each sequence (pages hold k / k_scale and
    v / v_scale) -> o `[T, Hq, D]`, written into `out` when given."""
    return _impl("attention", q).paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k, k_scale,
        v_scale, out=out
    )


def fp8_linear(x, weight, weight_scale_inv, block_size, activations=None):
    """x `[M, K]` times a block-scaled FP8 weight `[N, K]` (float32 `weight_scale_inv` per block) transposed, with x
    quantized to e4m3 per token-group of block_size[1] -> `[M, N]` in x's dtype; `activations` (`fp8_activations`
    of this x) is x already quantized, for several products on one input."""
    if not _use_triton(x):
        return quant_reference.fp8_linear(x, weight, weight_scale_inv, block_size)
    return _triton_module("fp8_gemm").fp8_linear(x, weight, weight_scale_inv, block_size, activations=activations)


def fp8_activations(x, group_size):
    """x quantized once per token and group of `group_size` channels for several `fp8_linear` products on it; None
    where the reference runs (it quantizes inside each product, at no launch cost)."""
    if not _use_triton(x):
        return None
    return _triton_module("fp8_gemm").Fp8Activations(x, group_size)


def w4a16_linear(x, qweight, scales, qzeros, group_size, awq_layout):
    """x `[M, K]` times a packed 4-bit weight (AWQ or compressed-tensors layout) transposed -> `[M, N]`."""
    return _impl("w4a16_gemm", x, quant_reference).w4a16_linear(x, qweight, scales, qzeros, group_size, awq_layout)


def rms_norm(x, weight, eps, residual=None, fp8_group=None, prefetch=()):
    """Zero-centred RMSNorm `norm(x) * (1 + w)` of x `[T, D]` or `[T, H, D]` (strided rows allowed); with `residual`,
    of `x + residual`, which is returned too. `fp8_group`: the output feeds FP8 projections quantizing per token and
    group of that many channels, and the Triton kernel writes it quantized too (the reference quantizes inside
    each product). `prefetch`: the tensors the projection after the norm reads, of which the Triton kernel asks the
    L2 cache for the head while it runs, at decode sizes (a hint; `triton_utils.l2_prefetch_plan`)."""
    if not _use_triton(x):
        return reference.rms_norm(x, weight, eps, residual)
    return _triton_module("elementwise").rms_norm(x, weight, eps, residual, fp8_group, prefetch)


def gated_rms_norm(x, gate, weight, eps):
    """`(w * rmsnorm(x)) * silu(gate)` over the last dim."""
    return _impl("elementwise", x).gated_rms_norm(x, gate, weight, eps)


def rotary(positions, q, k, inv_freq, rotary_dim):
    """NeoX rotary of the first `rotary_dim` dims of q `[T, Hq, D]` and k `[T, Hkv, D]` -> new (q, k)."""
    return _impl("elementwise", q).rotary(positions, q, k, inv_freq, rotary_dim)


def qk_norm_rotary(q, k, q_weight, k_weight, eps, positions, inv_freq, rotary_dim):
    """Attention's per-head RMSNorms of q `[T, Hq, D]` and k `[T, Hkv, D]` (`rms_norm`, strided heads allowed), then
    their NeoX rotary (`rotary`), in one launch -> new (q, k)."""
    return _impl("elementwise", q).qk_norm_rotary(q, k, q_weight, k_weight, eps, positions, inv_freq, rotary_dim)


def silu_and_mul(x, fp8_group=None):
    """SwiGLU of a merged `[gate | up]` projection `[T, 2F]` -> `[T, F]`; `fp8_group` as for `rms_norm`."""
    if not _use_triton(x):
        return reference.silu_and_mul(x)
    return _triton_module("elementwise").silu_and_mul(x, fp8_group)


__all__ = [
    "KERNEL_MODES",
    "kernel_mode",
    "causal_conv1d_decode",
    "causal_conv1d_prefill",
    "conv_gdn_prefill",
    "fused_moe",
    "gated_norm_linear",
    "gated_rms_norm",
    "gdn_decode",
    "fp8_activations",
    "fp8_linear",
    "gdn_prefill",
    "linear",
    "moe_route",
    "paged_attention",
    "qk_norm_rotary",
    "quant_reference",
    "reference",
    "rms_norm",
    "routed_moe",
    "rotary",
    "sigmoid_gated_linear",
    "silu_and_mul",
    "swiglu_linear",
    "w4a16_linear",
    "write_kv_cache",
]
