"""Quantized linear layers: each converted checkpoint projection is held exactly as stored (FP8 block-scaled, AWQ or
compressed-tensors W4A16; layouts in `hybridkv.sizing.quantization`) and multiplied by the quantized GEMMs, never
dequantized at load.

The model builds its projections on the meta device when its geometry is quantized; `quantize_linears` then gives
each one its real parameters: a converted projection becomes a `QuantizedLinear` holding the stored tensors, a merged
projection (`qkv_proj` = q|k|v, ...) becomes a `QuantizedMergedLinear` with one child per checkpoint projection
(named like it, so the loader finds `q_proj.weight_scale_inv` and friends) that concatenates their outputs, and a
projection the checkpoint keeps in 16 bits gets its dense weight. Every stored tensor carries a `ShardLayout` over
its own units (blocks, groups or packed words), so tensor parallelism reads each rank's rows from the checkpoint.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridkv import kernels
from hybridkv.sidecar.model.layers import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    ShardPart,
    all_reduce,
    sharded_parameter,
)
from hybridkv.sizing.quantization import AWQ, FP8, PACK_FACTOR, UnsupportedQuantizationError, WeightQuantization

STORED_TORCH_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16, "int32": torch.int32, "int64": torch.int64}


def _stored_axes(quantization: WeightQuantization, suffix: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((dim, elements per stored unit) of the output channels, the same of the input channels) of one stored tensor;
    None for tensors that are not split (weight_shape)."""
    block_rows, block_cols = quantization.block_size
    group = quantization.group_size
    axes = {
        "weight": ((0, 1), (1, 1)),
        "weight_scale_inv": ((0, block_rows), (1, block_cols)),
        "qweight": ((1, PACK_FACTOR), (0, 1)),
        "qzeros": ((1, PACK_FACTOR), (0, group)),
        "scales": ((1, 1), (0, group)),
        "weight_packed": ((0, 1), (1, PACK_FACTOR)),
        "weight_scale": ((0, 1), (1, group)),
        "weight_zero_point": ((0, PACK_FACTOR), (1, group)),
    }
    return axes.get(suffix)


def _stored_parts(parts: tuple[ShardPart, ...], per_unit: int, tp_size: int, what: str) -> tuple[ShardPart, ...]:
    """The shard parts of a stored tensor whose units each cover `per_unit` channels of the weight's `parts`."""
    if per_unit == 1:
        return parts
    if all(part.unit_size % per_unit == 0 for part in parts):
        return tuple(ShardPart(part.num_units, part.unit_size // per_unit) for part in parts)
    # Units narrower than a block (an MLP's single features): whole blocks per rank when each rank's share of the
    # units is a multiple of a block, so the ranks split the stored units exactly where they split the weight's.
    if all(per_unit % part.unit_size == 0 and part.num_units % (per_unit // part.unit_size * tp_size) == 0
           for part in parts):
        return tuple(ShardPart(part.num_units // (per_unit // part.unit_size), 1) for part in parts)
    if tp_size == 1:
        # One rank holds the whole tensor: the stored units run over the concatenated channels.
        return (ShardPart(1, math.ceil(sum(part.full_size for part in parts) / per_unit)),)
    raise UnsupportedQuantizationError(
        f"{what}: tensor parallel size {tp_size} would split a quantization block or group of {per_unit} channels "
        f"(heads of {parts[0].unit_size}); serve this checkpoint with a tensor parallel size that keeps them whole"
    )


class QuantizedLinear(nn.Module):
    """One checkpoint projection stored quantized; `dim` 0 splits its output channels, 1 its input channels."""

    def __init__(self, name: str, quantization: WeightQuantization, parts: tuple[ShardPart, ...], dim: int,
                 out_features: int, in_features: int, *, device, tp_rank: int, tp_size: int):
        super().__init__()
        quantization.check_shape(name, out_features, in_features)
        self.method = quantization.method
        self.block_size = quantization.block_size
        self.group_size = quantization.group_size
        self.tp_size = tp_size if dim == 1 else 1  # only a row-parallel projection sums partial outputs
        self.weight_zero_point = None
        for tensor in quantization.stored_tensors(out_features, in_features):
            axes = _stored_axes(quantization, tensor.suffix)
            if axes is None:
                param = sharded_parameter(tensor.shape, STORED_TORCH_DTYPES[tensor.dtype], device)
            else:
                stored_dim, per_unit = axes[dim]
                param = sharded_parameter(tensor.shape, STORED_TORCH_DTYPES[tensor.dtype], device, stored_dim,
                                          _stored_parts(parts, per_unit, tp_size, name), tp_rank, tp_size)
            setattr(self, tensor.suffix, param)

    def partial(self, x: torch.Tensor, fp8_activations=None) -> torch.Tensor:
        """This rank's partial output, before a row-parallel projection's all-reduce; `fp8_activations`: x already
        quantized for an FP8 projection (`kernels.fp8_activations`)."""
        if self.method == FP8:
            return kernels.fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size, fp8_activations)
        if self.method == AWQ:
            return kernels.w4a16_linear(x, self.qweight, self.scales, self.qzeros, self.group_size, True)
        return kernels.w4a16_linear(x, self.weight_packed, self.weight_scale, self.weight_zero_point,
                                    self.group_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x), self.tp_size)


class DenseLinear(nn.Module):
    """A checkpoint projection kept in the model dtype, as one child of a `QuantizedMergedLinear`."""

    def __init__(self, parts: tuple[ShardPart, ...], out_features: int, in_features: int, *, dtype, device,
                 tp_rank: int, tp_size: int):
        super().__init__()
        self.weight = sharded_parameter((out_features, in_features), dtype, device, 0, parts, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight)


class QuantizedMergedLinear(nn.Module):
    """A merged column-parallel projection whose checkpoint projections are held (and multiplied) one by one; the
    FP8 ones share one quantization of the input (one launch, not one per projection)."""

    def __init__(self, projections: dict[str, nn.Module], output_sizes: list[int]):
        super().__init__()
        self.output_sizes = output_sizes
        for name, module in projections.items():
            self.add_module(name, module)
        fp8 = [module for module in projections.values()
               if isinstance(module, QuantizedLinear) and module.method == FP8]
        self.shared_fp8_group = fp8_input_group(self) if len(fp8) > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_fp8_group is None:
            return torch.cat([projection(x) for projection in self.children()], dim=-1)
        shared = kernels.fp8_activations(x, self.shared_fp8_group)
        return torch.cat([projection.partial(x, shared) if isinstance(projection, QuantizedLinear) and
                          projection.method == FP8 else projection(x) for projection in self.children()], dim=-1)


def fp8_input_group(projection: nn.Module) -> int | None:
    """The channel group of the FP8 products on `projection`'s input (a projection, or a merged one of checkpoint
    projections) when they all quantize it alike; None when none is FP8. The kernel writing that input (a norm,
    SwiGLU) is given it, and writes the input quantized too."""
    if isinstance(projection, QuantizedMergedLinear):
        children = list(projection.children())
    else:
        children = [projection]
    groups = {child.block_size[1] for child in children if isinstance(child, QuantizedLinear) and child.method == FP8}
    return groups.pop() if len(groups) == 1 else None


def _materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give a projection built on the meta device its real (uninitialised) dense weight, same layout."""
    layout = module.weight.shard_layout
    module.weight = sharded_parameter(tuple(module.weight.shape), dtype, device, layout.dim, layout.parts,
                                      layout.tp_rank, layout.tp_size)


def quantize_linears(model: nn.Module, quantization: WeightQuantization, packed_names: dict, dtype: torch.dtype,
                     device: torch.device) -> None:
    """Replace the model's meta-device projections by what the checkpoint stores (see the module docstring);
    `packed_names` maps a merged projection to its checkpoint projections and their shard-part counts."""
    for path, module in list(model.named_modules()):
        if not isinstance(module, (MergedColumnParallelLinear, RowParallelLinear)):
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layout = module.weight.shard_layout
        out_features, in_features = module.weight.shape
        common = {"device": device, "tp_rank": layout.tp_rank, "tp_size": layout.tp_size}
        if isinstance(module, RowParallelLinear):
            if quantization.converts(path):
                setattr(parent, name, QuantizedLinear(path, quantization, layout.parts, 1, out_features, in_features,
                                                      **common))
            else:
                _materialize(module, dtype, device)
            continue
        projections, first = {}, 0
        for checkpoint_name, num_parts in packed_names[name]:
            parts = layout.parts[first : first + num_parts]
            rows = sum(part.rank_size(layout.tp_rank, layout.tp_size) for part in parts)
            full_name = f"{parent_path}.{checkpoint_name}"
            if quantization.converts(full_name):
                projections[checkpoint_name] = QuantizedLinear(full_name, quantization, parts, 0, rows, in_features,
                                                               **common)
            else:
                projections[checkpoint_name] = DenseLinear(parts, rows, in_features, dtype=dtype, **common)
            first += num_parts
        if all(isinstance(projection, DenseLinear) for projection in projections.values()):
            _materialize(module, dtype, device)
        else:
            setattr(parent, name, QuantizedMergedLinear(projections, module.output_sizes))
