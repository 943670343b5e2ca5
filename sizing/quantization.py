"""Quantized checkpoints, torch-free: which stored format each linear weight has, and what it costs in bytes.

`parse_quantization_config` reads a config.json's `quantization_config` into one `WeightQuantization`; the byte
model, the planner, the engine's layers, the loader and `make-model` all take each weight's stored tensors from it
(`stored_tensors`), so a quantized checkpoint is never counted at 16 bits. Formats served:

- `fp8`: fine-grained FP8 (`quant_method: fp8`, `fmt: e4m3`, `activation_scheme: dynamic`,
  `weight_block_size: [128, 128]`): `weight` float8_e4m3fn `[N, K]` and `weight_scale_inv` float32
  `[ceil(N/128), ceil(K/128)]`; the real weight is `weight * weight_scale_inv` per block.
- `awq`: AutoAWQ GEMM packing (`quant_method: awq`, `bits: 4`, `version: gemm`, `zero_point: true`): `qweight` int32
  `[K, N/8]`, `qzeros` int32 `[K/G, N/8]` (eight 4-bit values per int32 along N, in the order 0 2 4 6 1 3 5 7) and
  `scales` float16 `[K/G, N]`; the real weight is `(q - z) * s`, transposed.
- `w4a16`: compressed-tensors `pack-quantized` 4-bit integer weights with group scales and no activation quantization:
  `weight_packed` int32 `[N, ceil(K/8)]` (element i of a word at bits 4i, stored as q + 8), `weight_scale`
  `[N, ceil(K/G)]`, `weight_zero_point` int32 `[ceil(N/8), ceil(K/G)]` (packed along N, asymmetric only) and
  `weight_shape` int64 `[2]`; the real weight is `(q - z) * s`.

Modules named in `modules_to_not_convert` (fp8, awq) or `ignore` (compressed-tensors; `re:` entries are regular
expressions) stay in the model dtype. A plain entry matches whole dotted components ("mlp.gate" skips the MoE
router, not `gate_proj`). Embeddings, norms, the conv, `A_log`/`dt_bias` and the LM head are never quantized (AutoAWQ
and transformers' FP8 never convert the head; a checkpoint that stores it quantized fails the loader's name check). Any other method (GPTQ, bitsandbytes, ...) or variant is an `UnsupportedQuantizationError`
at parse time, so `plan` and the engine's start-up refuse it before a weight is read.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hybridkv.errors import excerpt
from hybridkv.sizing.errors import GeometryError

FP8 = "fp8"
AWQ = "awq"
W4A16 = "w4a16"
QUANTIZED_METHODS = (FP8, AWQ, W4A16)

# Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
FP8_BLOCK = (128, 128)
PACK_FACTOR = 8  # 4-bit values per int32
# From this many tokens the engine multiplies a 4-bit weight by dequantizing it once into the model dtype and handing
# it to the dense GEMM (`dequantized_weight_bytes`).
W4A16_DEQUANTIZE_MIN_TOKENS = 65
W4_SYMMETRIC_ZERO = 8  # compressed-tensors stores signed int4 as q + 8, so a symmetric weight's zero is 8
# Nibble of each of a group of 8 AWQ output columns (the inverse of AutoAWQ's packing order 0 2 4 6 1 3 5 7).
AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)

STORED_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int32": 4, "int64": 8}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
                       "I32": "int32", "I64": "int64", "F64": "float64", "I8": "int8", "U8": "uint8"}
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
MAX_IGNORE_ENTRIES = 100_000
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
# Static fp8 KV-cache scales: scalars the attention layers keep as numbers, not weights. Published names, under a
# layer's `self_attn.`: `k_scale`/`v_scale` (compressed-tensors, Quark), `k_proj.k_scale`/`v_proj.v_scale`
# (ModelOpt), and the older `kv_scale`, one scale for both.
KV_SCALE_NAMES = {"k_scale": ("k",), "v_scale": ("v",), "k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",),
                  "kv_scale": ("k", "v")}
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")


class UnsupportedQuantizationError(GeometryError):
    """A `quantization_config` whose method or variant hybridkv does not serve."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a linear layer stores in the checkpoint: `<module>.<suffix>`, its shape and dtype."""

    suffix: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * STORED_DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class WeightQuantization:
    """How a checkpoint's converted linear weights are stored (see the module docstring for the layouts)."""

    method: str
    block_size: tuple[int, int] = FP8_BLOCK  # fp8: rows (N) x columns (K) per scale
    group_size: int = 128  # 4-bit: input channels per scale / zero
    symmetric: bool = False  # w4a16 without zero points
    scale_dtype: str = "float16"  # 4-bit scales (awq: float16; compressed-tensors: the model dtype)
    not_converted: tuple[str, ...] = ()

    def converts(self, module_name: str) -> bool:
        """Whether the linear `module_name` (a checkpoint name, either text-model prefix) is stored quantized."""
        names = {module_name}
        if module_name.startswith("model.language_model."):
            names.add("model." + module_name[len("model.language_model."):])
        elif module_name.startswith("model."):
            names.add("model.language_model." + module_name[len("model."):])
        return not any(_matches(entry, name) for entry in self.not_converted for name in names)

    def stored_tensors(self, out_features: int, in_features: int) -> tuple[StoredTensor, ...]:
        """The tensors of one converted `[out_features, in_features]` linear weight, as the checkpoint stores them."""
        n, k = out_features, in_features
        if self.method == FP8:
            rows, cols = self.block_size
            return (StoredTensor("weight", (n, k), "float8_e4m3fn"),
                    StoredTensor("weight_scale_inv", (math.ceil(n / rows), math.ceil(k / cols)), "float32"))
        groups = math.ceil(k / self.group_size)
        if self.method == AWQ:
            return (StoredTensor("qweight", (k, n // PACK_FACTOR), "int32"),
                    StoredTensor("qzeros", (groups, n // PACK_FACTOR), "int32"),
                    StoredTensor("scales", (groups, n), self.scale_dtype))
        tensors = [StoredTensor("weight_packed", (n, math.ceil(k / PACK_FACTOR)), "int32"),
                   StoredTensor("weight_scale", (n, groups), self.scale_dtype)]
        if not self.symmetric:
            tensors.append(StoredTensor("weight_zero_point", (math.ceil(n / PACK_FACTOR), groups), "int32"))
        tensors.append(StoredTensor("weight_shape", (2,), "int64"))
        return tuple(tensors)

    def check_shape(self, module_name: str, out_features: int, in_features: int) -> None:
        """UnsupportedQuantizationError when this format cannot store a weight of this shape."""
        if self.method == AWQ and (out_features % PACK_FACTOR or in_features % self.group_size):
            raise UnsupportedQuantizationError(
                f"{module_name}: AWQ packs 8 output channels per int32 and {self.group_size} input channels per "
                f"group, but the weight is [{out_features}, {in_features}]; list it in modules_to_not_convert"
            )

    def config_entry(self, model_dtype: str) -> dict:
        """The `quantization_config` a checkpoint in this format carries (make-model writes it)."""
        skipped = list(self.not_converted)
        if self.method == FP8:
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(self.block_size), "modules_to_not_convert": skipped}
        if self.method == AWQ:
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": skipped}
        weights = {"num_bits": 4, "type": "int", "symmetric": self.symmetric, "strategy": "group",
                   "group_size": self.group_size, "dynamic": False, "actorder": None, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}},
                "ignore": skipped, "kv_cache_scheme": None}


def _matches(entry: str, name: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return name == entry or f".{name}.".find(f".{entry}.") >= 0 or name.startswith(entry + ".")


# ---- parsing quantization_config -----------------------------------------------------------------------------------
def _module_list(config: dict, key: str) -> tuple[str, ...]:
    entries = config.get(key) or []
    if not isinstance(entries, list) or len(entries) > MAX_IGNORE_ENTRIES or not all(
            isinstance(entry, str) for entry in entries):
        raise UnsupportedQuantizationError(f"quantization_config.{key} must be a list of module names")
    for entry in entries:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise UnsupportedQuantizationError(f"quantization_config.{key} entry {entry!r}: {exc}") from None
    return tuple(entries)


def _require(config: dict, key: str, allowed: tuple, what: str, default: Any = None) -> Any:
    value = config.get(key, default)
    # By type too: JSON's 4.0 is not the integer 4, nor 1 the boolean true.
    if not any(type(value) is type(option) and value == option for option in allowed):
        raise UnsupportedQuantizationError(
            f"quantization_config.{key} = {value!r} is not served; hybridkv serves {what} with {key} "
            f"{' or '.join(repr(a) for a in allowed)}"
        )
    return value


def _group_size(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= 65_536 or value % PACK_FACTOR:
        raise UnsupportedQuantizationError(
            f"quantization_config {key} = {value!r} is not served; use a positive multiple of 8 (128 is usual)"
        )
    return value


def _parse_fp8(config: dict) -> WeightQuantization:
    what = "fine-grained FP8"
    _require(config, "fmt", ("e4m3",), what, default="e4m3")
    _require(config, "activation_scheme", ("dynamic",), what, default="dynamic")
    block = config.get("weight_block_size")
    if block is None:
        raise UnsupportedQuantizationError(
            "quantization_config has quant_method 'fp8' without weight_block_size (per-tensor FP8); hybridkv serves "
            "block-scaled FP8 with weight_block_size [128, 128]"
        )
    if not isinstance(block, list) or block != list(FP8_BLOCK):
        raise UnsupportedQuantizationError(
            f"quantization_config.weight_block_size = {block!r} is not served; hybridkv's FP8 GEMM uses [128, 128]"
        )
    return WeightQuantization(FP8, not_converted=_module_list(config, "modules_to_not_convert"))


def _parse_awq(config: dict) -> WeightQuantization:
    what = "AWQ"
    _require(config, "bits", (4,), what, default=config.get("w_bit", 4))
    _require(config, "version", ("gemm", "GEMM"), what, default="gemm")
    _require(config, "zero_point", (True,), what, default=True)
    group = _group_size(config.get("group_size", config.get("q_group_size", 128)), "group_size")
    return WeightQuantization(AWQ, group_size=group, scale_dtype="float16",
                              not_converted=_module_list(config, "modules_to_not_convert"))


def _parse_compressed_tensors(config: dict, model_dtype: str) -> WeightQuantization:
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise UnsupportedQuantizationError(
            "quantization_config.config_groups must hold exactly one group; hybridkv serves compressed-tensors "
            "checkpoints with one W4A16 scheme for every Linear"
        )
    (group,) = groups.values()
    if not isinstance(group, dict):
        raise UnsupportedQuantizationError("quantization_config.config_groups entries must be objects")
    fmt = group.get("format") or config.get("format")
    if fmt != "pack-quantized":
        raise UnsupportedQuantizationError(
            f"compressed-tensors format {fmt!r} is not served; hybridkv serves 'pack-quantized' W4A16"
        )
    if group.get("targets") != ["Linear"]:
        raise UnsupportedQuantizationError(
            f"compressed-tensors targets {group.get('targets')!r} are not served; hybridkv serves ['Linear']"
        )
    if group.get("input_activations") or group.get("output_activations"):
        raise UnsupportedQuantizationError(
            "compressed-tensors activation quantization is not served; hybridkv serves W4A16 (weights only)"
        )
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise UnsupportedQuantizationError("compressed-tensors scheme has no 'weights' object")
    what = "compressed-tensors W4A16"
    _require(weights, "num_bits", (4,), what)
    _require(weights, "type", ("int",), what, default="int")
    _require(weights, "strategy", ("group",), what)
    _require(weights, "dynamic", (False,), what, default=False)
    _require(weights, "actorder", (None, False), what, default=None)
    symmetric = _require(weights, "symmetric", (True, False), what, default=True)
    return WeightQuantization(W4A16, group_size=_group_size(weights.get("group_size"), "weights.group_size"),
                              symmetric=symmetric, scale_dtype=model_dtype,
                              not_converted=_module_list(config, "ignore"))


def parse_quantization_config(config: Any, model_dtype: str) -> WeightQuantization | None:
    """The stored format of a config.json's `quantization_config` (None when absent)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise UnsupportedQuantizationError("quantization_config must be a JSON object")
    method = config.get("quant_method")
    if method == "fp8":
        return _parse_fp8(config)
    if method == "awq":
        return _parse_awq(config)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(config, model_dtype)
    raise UnsupportedQuantizationError(
        f"quantization_config.quant_method {method!r} is not served; hybridkv serves fp8 (block-scaled e4m3), "
        "awq (4-bit GEMM packing) and compressed-tensors (pack-quantized W4A16); use one of those checkpoints or "
        "the 16-bit one"
    )


# ---- which linears a geometry has, per rank -------------------------------------------------------------------------
def linear_layers(geometry, tp: int = 1) -> list[tuple[str, int, int]]:
    """(checkpoint module name, out features, in features) of every linear layer one rank holds but the LM head;
    shapes follow `ModelGeometry.parameter_counts`."""
    hidden = geometry.hidden_size
    q_heads = geometry.num_attention_heads // tp
    kv_out = max(1, geometry.num_key_value_heads // tp) * geometry.head_dim
    q_out = q_heads * geometry.head_dim * (2 if geometry.attn_output_gate else 1)
    k_out = geometry.linear_num_key_heads // tp * geometry.linear_key_head_dim
    v_heads = geometry.linear_num_value_heads // tp
    v_out = v_heads * geometry.linear_value_head_dim
    layers = []
    sparse = set(geometry.sparse_layer_ids)
    for i, kind in enumerate(geometry.layer_types):
        prefix = f"model.layers.{i}"
        if kind == "linear_attention" and geometry.model_type == "qwen3_next":
            # Qwen3-Next stores the GDN input projections fused, grouped by key head.
            layers += [(f"{prefix}.linear_attn.in_proj_qkvz", 2 * k_out + 2 * v_out, hidden),
                       (f"{prefix}.linear_attn.in_proj_ba", 2 * v_heads, hidden),
                       (f"{prefix}.linear_attn.out_proj", hidden, v_out)]
        elif kind == "linear_attention":
            layers += [(f"{prefix}.linear_attn.in_proj_qkv", 2 * k_out + v_out, hidden),
                       (f"{prefix}.linear_attn.in_proj_z", v_out, hidden),
                       (f"{prefix}.linear_attn.in_proj_b", v_heads, hidden),
                       (f"{prefix}.linear_attn.in_proj_a", v_heads, hidden),
                       (f"{prefix}.linear_attn.out_proj", hidden, v_out)]
        else:
            layers += [(f"{prefix}.self_attn.q_proj", q_out, hidden), (f"{prefix}.self_attn.k_proj", kv_out, hidden),
                       (f"{prefix}.self_attn.v_proj", kv_out, hidden),
                       (f"{prefix}.self_attn.o_proj", hidden, q_heads * geometry.head_dim)]
        if i in sparse:
            width = geometry.moe_intermediate_size // tp
            experts = [f"{prefix}.mlp.experts.{e}" for e in range(geometry.num_experts)]
            mlps = [(name, width) for name in experts]
            if geometry.shared_expert_intermediate_size:
                mlps.append((f"{prefix}.mlp.shared_expert", geometry.shared_expert_intermediate_size // tp))
            layers += [(f"{prefix}.mlp.gate", geometry.num_experts, hidden),
                       (f"{prefix}.mlp.shared_expert_gate", 1, hidden)]
        else:
            mlps = [(f"{prefix}.mlp", geometry.intermediate_size // tp)]
        for name, width in mlps:
            layers += [(f"{name}.gate_proj", width, hidden), (f"{name}.up_proj", width, hidden),
                       (f"{name}.down_proj", hidden, width)]
    return layers


def channel_unit(quantization: WeightQuantization) -> int:
    """Channels of a tensor-parallel MLP that must stay on one rank: an FP8 block along both split dims (the
    gate/up output rows, the down projection's input columns); for 4-bit formats, the eight channels of a packed word
    and a scale group along the input."""
    if quantization.method == FP8:
        return math.lcm(*quantization.block_size)
    return math.lcm(PACK_FACTOR, quantization.group_size)


def tensor_parallel_problems(geometry, quantization: WeightQuantization, tp: int) -> list[str]:
    """Why `tp` would split a quantization block or group of a converted MLP, dense, expert or shared expert
    (empty when every rank's share of their channels is whole units); the engine refuses such a split at start-up."""
    if tp == 1:
        return []
    unit = channel_unit(quantization)
    sparse = set(geometry.sparse_layer_ids)
    dense = [i for i in range(geometry.num_hidden_layers) if i not in sparse]
    first_sparse = min(sparse) if sparse else None
    families = []
    if dense:
        families.append(("MLP channels", f"model.layers.{dense[0]}.mlp.down_proj", geometry.intermediate_size))
    if first_sparse is not None:
        families.append(("expert channels", f"model.layers.{first_sparse}.mlp.experts.0.down_proj",
                         geometry.moe_intermediate_size))
        if geometry.shared_expert_intermediate_size:
            families.append(("shared-expert channels", f"model.layers.{first_sparse}.mlp.shared_expert.down_proj",
                             geometry.shared_expert_intermediate_size))
    problems = []
    for what, module, channels in families:
        # A tp that does not divide the channels at all is reported by the byte model's own check.
        if channels and channels % tp == 0 and channels // tp % unit and quantization.converts(module):
            problems.append(f"tp={tp} would give each rank {channels // tp} of the {channels} {what}, which the "
                            f"{quantization.method} checkpoint stores in units of {unit}")
    return problems


def dequantized_weight_bytes(geometry, tp: int, max_num_batched_tokens: int) -> int:
    """Bytes of the largest 4-bit weight one rank dequantizes into the model dtype for a prefill-sized product
    (`W4A16_DEQUANTIZE_MIN_TOKENS` tokens or more): transient memory of such a step, freed after the product. 0
    without 4-bit weights or when no step batches that many tokens."""
    quantization = geometry.quantization
    if quantization is None or quantization.method == FP8 or max_num_batched_tokens < W4A16_DEQUANTIZE_MIN_TOKENS:
        return 0
    return max((out_features * in_features for name, out_features, in_features in linear_layers(geometry, tp)
                if quantization.converts(name)), default=0) * STORED_DTYPE_BYTES[geometry.dtype]


def stored_bytes_change(geometry, quantization: WeightQuantization, tp: int = 1) -> int:
    """Bytes one rank's converted linears store minus what they would take in the model dtype (negative)."""
    dense_bytes = STORED_DTYPE_BYTES[geometry.dtype]
    change = 0
    for name, out_features, in_features in linear_layers(geometry, tp):
        if quantization.converts(name):
            stored = sum(t.nbytes for t in quantization.stored_tensors(out_features, in_features))
            change += stored - out_features * in_features * dense_bytes
    return change


# ---- exact bytes from safetensors headers ---------------------------------------------------------------------------
def _header(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise GeometryError(f"{path} is not a safetensors file (shorter than its header length)")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_SAFETENSORS_HEADER_BYTES:
                raise GeometryError(f"{path}: safetensors header of {length} bytes is larger than "
                                    f"{MAX_SAFETENSORS_HEADER_BYTES}; it is not a safetensors file")
            header = json.loads(handle.read(length))
    except OSError as exc:
        raise GeometryError(f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GeometryError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise GeometryError(f"{path}: safetensors header must be a JSON object")
    return header


def checkpoint_tensors(location: str | Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, bytes) of every tensor in a folder of safetensors, an index file, or one file,
    read from the headers only."""
    location = Path(location)
    if location.is_dir():
        index = location / "model.safetensors.index.json"
        files = _index_files(index) if index.is_file() else sorted(location.glob("*.safetensors"))
    elif location.name.endswith(".index.json"):
        files = _index_files(location)
    else:
        files = [location]
    if not files:
        raise GeometryError(f"no *.safetensors files in {location}")
    tensors = {}
    for path in files:
        for name, info in _header(path).items():
            if name == "__metadata__":
                continue
            tensors[name] = _header_entry(path, name, info)
    return tensors


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _header_entry(path: Path, name: str, info) -> tuple[str, tuple[int, ...], int]:
    """(dtype, shape, bytes) of one safetensors header entry, checked as the format defines it: a dtype name, a
    shape of sizes, and data offsets [start, end) whose span is the shape's elements at the dtype's size."""
    where = f"{path}: header entry {excerpt(name)}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise GeometryError(f"{where} has no dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise GeometryError(f"{where}: dtype must be a name such as BF16, got {excerpt(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(size) for size in shape):
        raise GeometryError(f"{where}: shape must be a list of sizes, got {excerpt(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(offset) for offset in offsets)
            and offsets[0] <= offsets[1]):
        raise GeometryError(f"{where}: data_offsets must be [start, end] with 0 <= start <= end, got "
                            f"{excerpt(offsets)}")
    dtype = _SAFETENSORS_DTYPES.get(dtype, dtype)
    size = offsets[1] - offsets[0]
    if dtype in STORED_DTYPE_BYTES and size != math.prod(shape) * STORED_DTYPE_BYTES[dtype]:
        raise GeometryError(f"{where}: data_offsets span {size} bytes but shape {shape} of {dtype} takes "
                            f"{math.prod(shape) * STORED_DTYPE_BYTES[dtype]}; the file is damaged")
    return dtype, tuple(shape), size


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # ValueError: bad JSON or UTF-8
        raise GeometryError(f"{index} is not a safetensors index ({str(exc)[:200]})") from None
    if any(not isinstance(name, str) or Path(name).name != name for name in names):
        raise GeometryError(f"{index} names files outside its folder")
    return [index.parent / name for name in names]


def holds_safetensors(folder: str | Path) -> bool:
    """The folder has weights to read headers from (a safetensors index or *.safetensors files)."""
    folder = Path(folder)
    return (folder / "model.safetensors.index.json").is_file() or any(folder.glob("*.safetensors"))


# The headers' weight bytes may differ from what config.json describes by the odd tensor the formula leaves out, not
# by this factor either way: past it the folder is missing files or holds another model than its config.
CHECKPOINT_BYTES_FACTOR = 2


def with_checkpoint_bytes(geometry, folder: str | Path):
    """`geometry` with the exact text-model weight bytes of the checkpoint in `folder` (its safetensors headers),
    when it holds one; unchanged otherwise. Refuses headers that hold a fraction or a multiple of the weights the
    config describes, which planned on would promise memory the weights take, or waste it."""
    if not holds_safetensors(folder):
        return geometry
    counted = text_model_tensor_bytes(folder, geometry.tie_word_embeddings)
    described = geometry.weights_bytes(1)
    if not described / CHECKPOINT_BYTES_FACTOR <= counted <= described * CHECKPOINT_BYTES_FACTOR:
        raise GeometryError(
            f"{folder}: its safetensors headers hold {counted:,} bytes of text-model weights, but its config.json "
            f"describes {described:,}; shards are missing, or the config is not this checkpoint's"
        )
    return replace(geometry, checkpoint_weights_bytes=counted)


def text_model_tensor_bytes(location: str | Path, tie_word_embeddings: bool) -> int:
    """Bytes of the weights the text model loads (no vision tower, no MTP head, no tied LM head copy, no KV scales)."""
    return sum(
        size for name, (_, _, size) in checkpoint_tensors(location).items()
        if not name.startswith(_SKIPPED_PREFIXES) and not name.endswith(KV_SCALE_SUFFIXES)
        and not (tie_word_embeddings and name == "lm_head.weight")
    )
