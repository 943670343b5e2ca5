"""Plain-torch references of the quantized GEMMs (`fp8_linear`, `w4a16_linear`), with the dispatcher's signatures: each
dequantizes its operands to float32 and multiplies. Layouts are those of `hybridkv.sizing.quantization`.

The FP8 GEMM quantizes activations per token and per group of 128 input channels to e4m3 on the fly (scale = group
amax / 448), as the Triton kernel does, so the reference and the kernel differ only by summation order. The writers
at the end (`quantize_fp8_block`, `quantize_w4`) produce the stored formats for random checkpoints.
"""

from __future__ import annotations

import torch

from hybridkv.sizing.quantization import AWQ_COLUMN_NIBBLE, E4M3_MAX, PACK_FACTOR, W4_SYMMETRIC_ZERO

# Activation group amax below this is treated as this, so an all-zero group gets a finite scale.
MIN_AMAX = 1e-10
_NIBBLE_SHIFTS = torch.arange(PACK_FACTOR, dtype=torch.int32) * 4
_AWQ_SHIFTS = torch.tensor(AWQ_COLUMN_NIBBLE, dtype=torch.int32) * 4


def unpack_int4(packed: torch.Tensor, count: int, awq_order: bool = False) -> torch.Tensor:
    """int32 `[..., W]` holding eight 4-bit values each along the last dim -> int32 values `[..., count]` in 0..15.

    Sequential order: value i of a word is bits 4i..4i+3 (compressed-tensors); AWQ order: column c of a group of 8
    is nibble `AWQ_COLUMN_NIBBLE[c]`."""
    shifts = (_AWQ_SHIFTS if awq_order else _NIBBLE_SHIFTS).to(packed.device)
    values = (packed[..., None] >> shifts) & 0xF
    return values.reshape(*packed.shape[:-1], -1)[..., :count]


def _expand_groups(per_group: torch.Tensor, group_size: int, count: int, dim: int) -> torch.Tensor:
    return per_group.repeat_interleave(group_size, dim=dim).narrow(dim, 0, count)


def dequantize_w4(qweight, scales, qzeros, group_size: int, awq_layout: bool, in_features: int) -> torch.Tensor:
    """The float32 weight `[N, K]` of a 4-bit linear: `(q - z) * s` per group of `group_size` input channels.

    AWQ: qweight `[K, N/8]`, qzeros `[K/G, N/8]` (both AWQ order), scales `[K/G, N]`. compressed-tensors: qweight
    `[N, ceil(K/8)]`, scales `[N, ceil(K/G)]`, qzeros `[ceil(N/8), ceil(K/G)]` packed along N, or None (zero 8)."""
    if awq_layout:
        out_features = scales.shape[1]
        q = unpack_int4(qweight, out_features, awq_order=True)  # [K, N]
        z = _expand_groups(unpack_int4(qzeros, out_features, awq_order=True), group_size, in_features, 0)
        s = _expand_groups(scales.float(), group_size, in_features, 0)
        return ((q - z).float() * s).t()
    out_features = qweight.shape[0]
    q = unpack_int4(qweight, in_features)  # [N, K]
    if qzeros is None:
        z = torch.full_like(q, W4_SYMMETRIC_ZERO)
    else:
        z = _expand_groups(unpack_int4(qzeros.t(), out_features).t(), group_size, in_features, 1)
    return (q - z).float() * _expand_groups(scales.float(), group_size, in_features, 1)


def w4a16_linear(x, qweight, scales, qzeros, group_size: int, awq_layout: bool):
    """x `[M, K]` times the 4-bit weight's transpose -> `[M, N]` in x's dtype."""
    weight = dequantize_w4(qweight, scales, qzeros, group_size, awq_layout, x.shape[1])
    return (x.float() @ weight.t()).to(x.dtype)


def dequantize_fp8_block(weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size) -> torch.Tensor:
    """`weight * weight_scale_inv` per `block_size` = (rows, cols) block, in float32 `[N, K]`."""
    rows, cols = block_size
    n, k = weight.shape
    scale = _expand_groups(_expand_groups(weight_scale_inv.float(), rows, n, 0), cols, k, 1)
    return weight.float() * scale


def quantize_activations_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and group of `group_size` channels: e4m3 values `[M, K]` and float32 scales `[M, ceil(K/G)]`."""
    m, k = x.shape
    groups = -(-k // group_size)
    padded = torch.zeros(m, groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    padded = padded.view(m, groups, group_size)
    scales = padded.abs().amax(-1).clamp(min=MIN_AMAX) / E4M3_MAX
    values = (padded / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.view(m, -1)[:, :k], scales


def fp8_linear(x, weight, weight_scale_inv, block_size):
    """x `[M, K]` (activations quantized per token-group of block_size[1]) times the block-scaled FP8 weight
    `[N, K]` transposed -> `[M, N]` in x's dtype."""
    values, scales = quantize_activations_fp8(x, block_size[1])
    activations = values.float() * _expand_groups(scales, block_size[1], x.shape[1], 1)
    return (activations @ dequantize_fp8_block(weight, weight_scale_inv, block_size).t()).to(x.dtype)


# ---- writing the stored formats (random checkpoints, tests) ---------------------------------------------------------
def quantize_fp8_block(weight: torch.Tensor, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight `[N, K]` -> (e4m3 weight `[N, K]`, float32 `weight_scale_inv` per block = block amax / 448)."""
    rows, cols = block_size
    n, k = weight.shape
    grid_rows, grid_cols = -(-n // rows), -(-k // cols)
    padded = torch.zeros(grid_rows * rows, grid_cols * cols, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.view(grid_rows, rows, grid_cols, cols)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / E4M3_MAX
    values = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.view(grid_rows * rows, grid_cols * cols)[:n, :k].contiguous(), scale_inv


def pack_int4(values: torch.Tensor, awq_order: bool = False) -> torch.Tensor:
    """int values 0..15 `[..., C]` -> int32 words `[..., ceil(C/8)]`, the inverse of `unpack_int4`."""
    count = values.shape[-1]
    words = -(-count // PACK_FACTOR)
    padded = torch.zeros(*values.shape[:-1], words * PACK_FACTOR, dtype=torch.int64, device=values.device)
    padded[..., :count] = values.long()
    shifts = (_AWQ_SHIFTS if awq_order else _NIBBLE_SHIFTS).long().to(values.device)
    packed = (padded.view(*values.shape[:-1], words, PACK_FACTOR) << shifts).sum(-1)
    # Two's complement: the top nibble's high bit is the int32 sign bit.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize_w4(weight: torch.Tensor, group_size: int, awq_layout: bool, symmetric: bool,
                scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A float weight `[N, K]` -> its stored 4-bit tensors (AWQ or compressed-tensors names and layouts), with
    min/max group scales (asymmetric) or amax / 7.5 (symmetric, q in -8..7)."""
    n, k = weight.shape
    groups = -(-k // group_size)
    padded = torch.zeros(n, groups * group_size, dtype=torch.float32, device=weight.device)
    padded[:, :k] = weight.float()
    grouped = padded.view(n, groups, group_size)
    if symmetric:
        scale = (grouped.abs().amax(-1) / 7.5).clamp(min=MIN_AMAX).to(scale_dtype)
        zero = torch.full((n, groups), W4_SYMMETRIC_ZERO, dtype=torch.int64, device=weight.device)
    else:
        low, high = grouped.amin(-1).clamp(max=0.0), grouped.amax(-1).clamp(min=0.0)
        scale = ((high - low) / 15).clamp(min=MIN_AMAX).to(scale_dtype)
        zero = (-low / scale.float()).round().clamp(0, 15).long()
    q = ((grouped / scale.float()[..., None]).round() + zero[..., None]).clamp(0, 15).long().view(n, -1)[:, :k]
    if awq_layout:
        return {"qweight": pack_int4(q.t(), awq_order=True), "qzeros": pack_int4(zero.t(), awq_order=True),
                "scales": scale.t().contiguous()}
    stored = {"weight_packed": pack_int4(q), "weight_scale": scale.contiguous()}
    if not symmetric:
        stored["weight_zero_point"] = pack_int4(zero.t()).t().contiguous()
    stored["weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
    return stored
