"""Text-model geometry of hybrid Gated DeltaNet + full-attention models, and their parameter count per rank.

`geometry_from_config` reads a Hugging Face `config.json` (Qwen3.5/3.6 dense and MoE, text-only or a vision-language
wrapper with `text_config`, Qwen3-Next); `catalog_geometry` returns the built-in models of `data/models.json`, which go
through the same parser.

Weights are counted as the engine shards them over `tp` ranks (Megatron-style):
- column-parallel, split by output channels: q/k/v, GDN `in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a` (Qwen3-Next's
  fused `in_proj_qkvz`/`in_proj_ba` hold the same parameters), MLP and expert gate/up, the shared expert's gate/up;
- row-parallel, split by input channels: attention `o_proj`, GDN `out_proj`, MLP/expert/shared-expert `down_proj`;
- sharded with their channels: GDN `conv1d` (per conv channel), `A_log` and `dt_bias` (per value head);
- K/V projections split by KV head, or replicated when tp is a multiple of the KV heads (one head per rank);
- replicated on every rank: RMSNorm weights (layer, q/k, gated GDN norm, final), the MoE router and shared-expert gate;
- vocab-parallel embedding and untied LM head: the vocabulary is padded up to a multiple of tp and split evenly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

from hybridkv.errors import excerpt
from hybridkv.sizing.errors import GeometryError, UnknownModelError
from hybridkv.sizing.quantization import FP8, WeightQuantization, parse_quantization_config, stored_bytes_change

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

# Storage size of the dtypes a pool or a weight can have (names as torch spells them).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}

# The Hugging Face model types whose layers hybridkv knows (text configs; VL wrappers are unwrapped first).
SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
_WRAPPER_TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

# Upper bounds on config values: a config.json is user input.
MAX_HIDDEN_SIZE = 65_536
MAX_LAYERS = 1_024
MAX_VOCAB_SIZE = 4_194_304
MAX_HEADS = 1_024
MAX_HEAD_DIM = 1_024
MAX_INTERMEDIATE_SIZE = 1_048_576
MAX_EXPERTS = 4_096
MAX_CONV_KERNEL = 64
MAX_POSITION_EMBEDDINGS = 16_777_216

# transformers' defaults for keys a Qwen3.5/Qwen3-Next config may leave out.
_DEFAULT_FULL_ATTENTION_INTERVAL = 4
_DEFAULT_ROPE_THETA = 10_000.0
_DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
_DEFAULT_MAX_POSITION_EMBEDDINGS = 32_768
_DEFAULT_RMS_NORM_EPS = 1e-6


def normalize_dtype(name: str, what: str = "dtype") -> str:
    """The canonical dtype name ("bfloat16", ...) for a torch or short spelling; GeometryError if unknown."""
    if not isinstance(name, str):
        raise GeometryError(f"{what} must be a dtype name such as 'bfloat16', got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise GeometryError(f"{what} {name!r} is not a supported dtype; use one of {', '.join(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[normalize_dtype(name)]


def _sparse_layer_ids(
    num_layers: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: tuple[int, ...]
) -> tuple[int, ...]:
    """Layers whose MLP is a mixture of experts (transformers' rule for Qwen3-Next and Qwen3.5-MoE)."""
    if num_experts == 0:
        return ()
    return tuple(i for i in range(num_layers) if i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(frozen=True)
class VisionGeometry:
    """The vision tower of a vision-language checkpoint (Qwen3-VL style ViT and patch merger, `vision_config`).

    hybridkv's engine serves text and never loads it; vLLM loads and profiles it, so its columns count its weights.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    num_deepstack_mergers: int = 0

    def parameters_per_rank(self, tp: int = 1) -> int:
        """Parameters one rank holds with the tower sharded as vLLM shards it: q/k/v, fc1 and the mergers' first
        layer by output channel, proj, fc2 and the mergers' second layer by input channel; patch and position
        embeddings, LayerNorms and row-parallel biases replicated."""
        hidden, inner, out = self.hidden_size, self.intermediate_size, self.out_hidden_size
        merged = hidden * self.spatial_merge_size**2
        patch = self.in_channels * self.temporal_patch_size * self.patch_size**2 * hidden + hidden
        positions = self.num_position_embeddings * hidden
        block_sharded = (hidden * 3 * hidden + 3 * hidden) + hidden * hidden + (hidden * inner + inner) + inner * hidden
        block_replicated = 4 * hidden + hidden + hidden  # two LayerNorms (weight + bias), proj and fc2 biases
        merger_sharded = (merged * merged + merged) + merged * out
        merger_replicated = out  # fc2 bias
        # The final merger normalizes the tower's width; deepstack mergers normalize after the merge.
        norms = 2 * hidden + self.num_deepstack_mergers * 2 * merged
        mergers = 1 + self.num_deepstack_mergers
        sharded = self.depth * block_sharded + mergers * merger_sharded
        replicated = patch + positions + self.depth * block_replicated + mergers * merger_replicated + norms
        return sharded // tp + replicated


def vision_from_config(config: Any, text_hidden_size: int) -> VisionGeometry:
    """A VisionGeometry from a `vision_config` object; GeometryError names the bad key."""
    if not isinstance(config, dict):
        raise GeometryError("vision_config must be a JSON object")

    def integer(key: str, default: int | None = None, upper: int = MAX_INTERMEDIATE_SIZE) -> int:
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
            raise GeometryError(f"vision_config key {key!r} must be an integer in [1, {upper}], got {value!r}")
        return value

    deepstack = config.get("deepstack_visual_indexes") or []
    if not isinstance(deepstack, list) or len(deepstack) > MAX_LAYERS:
        raise GeometryError("vision_config key 'deepstack_visual_indexes' must be a list of layer indices")
    return VisionGeometry(
        depth=integer("depth", upper=MAX_LAYERS),
        hidden_size=integer("hidden_size", upper=MAX_HIDDEN_SIZE),
        intermediate_size=integer("intermediate_size"),
        out_hidden_size=integer("out_hidden_size", text_hidden_size, MAX_HIDDEN_SIZE),
        in_channels=integer("in_channels", 3, 16),
        patch_size=integer("patch_size", 16, 1024),
        temporal_patch_size=integer("temporal_patch_size", 2, 64),
        spatial_merge_size=integer("spatial_merge_size", 2, 64),
        num_position_embeddings=integer("num_position_embeddings", 2304, MAX_POSITION_EMBEDDINGS),
        num_deepstack_mergers=len(deepstack),
    )


@dataclass(frozen=True)
class ModelGeometry:
    """What the memory model and the engine need to know about a hybrid text model (Hugging Face config names)."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    vocab_size: int
    intermediate_size: int  # dense MLP width; 0 when every layer is a MoE layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    attn_output_gate: bool
    dtype: str
    mamba_ssm_dtype: str | None
    hidden_act: str = "silu"
    attention_bias: bool = False
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # How converted linear weights are stored (None: every weight in `dtype`).
    quantization: WeightQuantization | None = None
    # Exact single-rank weight bytes read from the checkpoint's safetensors headers, when a folder was given.
    checkpoint_weights_bytes: int | None = None
    vision: VisionGeometry | None = None  # the vision tower of a VL checkpoint; never counted in the text weights

    # ---- layer structure -------------------------------------------------------------------------------------
    @property
    def full_attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def linear_attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def num_full_attention_layers(self) -> int:
        return len(self.full_attention_layer_ids)

    @property
    def num_linear_attention_layers(self) -> int:
        return len(self.linear_attention_layer_ids)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sparse_layer_ids(self) -> tuple[int, ...]:
        return _sparse_layer_ids(
            self.num_hidden_layers, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers
        )

    def _stored_quantized(self, module: str) -> bool:
        """Whether linear `module` of the first sparse layer's MLP is stored quantized."""
        return self.quantization is not None and self.quantization.converts(
            f"model.layers.{self.sparse_layer_ids[0]}.mlp.{module}")

    @property
    def fp8_experts(self) -> bool:
        """Whether the checkpoint stores the routed experts in block-scaled e4m3 (the engine refuses the other
        quantized expert formats)."""
        return (self.quantization is not None and self.quantization.method == FP8 and bool(self.sparse_layer_ids)
                and self._stored_quantized("experts.0.gate_proj"))

    @property
    def shared_expert_in_stack(self) -> bool:
        """Whether the engine runs the shared expert as the last expert of the routed experts' stack: as wide as a
        routed expert and stored as they are (all three projections quantized as the experts, or all in 16 bits)."""
        if not (self.shared_expert_intermediate_size and self.sparse_layer_ids):
            return False
        if self.shared_expert_intermediate_size != self.moe_intermediate_size:
            return False
        return all(self._stored_quantized(f"shared_expert.{projection}") == self.fp8_experts
                   for projection in ("gate_proj", "up_proj", "down_proj"))

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv (q, k and v before the conv), for the whole model (tp=1)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def default_ssm_dtype(self) -> str:
        """Recurrent-state dtype: the config's `mamba_ssm_dtype` (fp32 for Qwen3.5/3.6), else the model dtype."""
        return self.mamba_ssm_dtype or self.dtype

    # ---- parameters ------------------------------------------------------------------------------------------
    def parameter_counts(self, tp: int = 1) -> dict[str, int]:
        """Parameters one rank holds at tensor-parallel size `tp`, by part (see the module docstring for the split).

        `tp` is not validated here; callers go through `check_tensor_parallel_size` first.
        """
        hidden = self.hidden_size
        vocab_rows = _ceil_div(self.vocab_size, tp)
        q_heads = self.num_attention_heads // tp
        kv_heads = max(1, self.num_key_value_heads // tp)
        q_out = q_heads * self.head_dim * (2 if self.attn_output_gate else 1)
        kv_out = kv_heads * self.head_dim
        attention = (
            hidden * (q_out + 2 * kv_out)
            + q_heads * self.head_dim * hidden
            + (q_out + 2 * kv_out + hidden if self.attention_bias else 0)
            + 2 * self.head_dim
        )
        value_heads = self.linear_num_value_heads // tp
        conv_channels = self.conv_dim // tp
        value_channels = self.value_dim // tp
        linear_attention = (
            hidden * (conv_channels + value_channels + 2 * value_heads)  # in_proj_qkv, z, b, a
            + conv_channels * self.linear_conv_kernel_dim
            + 2 * value_heads  # A_log, dt_bias
            + self.linear_value_head_dim  # gated RMSNorm over one value head
            + value_channels * hidden  # out_proj
        )
        dense_mlp = 3 * hidden * (self.intermediate_size // tp)
        sparse_mlp = (
            self.num_experts * 3 * hidden * (self.moe_intermediate_size // tp)
            + self.num_experts * hidden  # router
            + 3 * hidden * (self.shared_expert_intermediate_size // tp)
            + hidden  # shared-expert gate
        )
        num_sparse = len(self.sparse_layer_ids)
        embedding = vocab_rows * hidden
        return {
            "embedding": embedding,
            "lm_head": 0 if self.tie_word_embeddings else embedding,
            "full_attention": self.num_full_attention_layers * attention,
            "linear_attention": self.num_linear_attention_layers * linear_attention,
            "mlp": (self.num_hidden_layers - num_sparse) * dense_mlp + num_sparse * sparse_mlp,
            "norms": self.num_hidden_layers * 2 * hidden + hidden,
        }

    def parameters_per_rank(self, tp: int = 1) -> int:
        return sum(self.parameter_counts(tp).values())

    def num_parameters(self) -> int:
        """Parameters of the text model (no vision tower, no MTP head), tied embeddings counted once."""
        return self.parameters_per_rank(1)

    def weights_bytes(self, tp: int = 1) -> int:
        """Weight bytes one rank holds, each tensor as the checkpoint stores it (headers' bytes at tp=1 when known)."""
        if tp == 1 and self.checkpoint_weights_bytes is not None:
            return self.checkpoint_weights_bytes
        dense = self.parameters_per_rank(tp) * dtype_bytes(self.dtype)
        return dense + (stored_bytes_change(self, self.quantization, tp) if self.quantization else 0)

    def vision_weights_bytes(self, tp: int = 1) -> int:
        """Bytes of the vision tower on one rank (0 for a text-only checkpoint), in the model dtype."""
        return 0 if self.vision is None else self.vision.parameters_per_rank(tp) * dtype_bytes(self.dtype)


# ---- parsing a config.json ---------------------------------------------------------------------------------------
def _text_config(config: dict) -> tuple[dict, dict]:
    """(text config, wrapper) for a VL wrapper with `text_config`, or (config, {}) for a text-only config."""
    if not isinstance(config, dict):
        raise GeometryError(f"a model config must be a JSON object, got {type(config).__name__}")
    text = config.get("text_config")
    if text is None:
        return config, {}
    if not isinstance(text, dict):
        raise GeometryError("text_config must be a JSON object")
    return text, config


class _Reader:
    """Reads typed keys from the text config, falling back to the wrapper for keys a VL config keeps at top level."""

    def __init__(self, text: dict, wrapper: dict):
        self.text = text
        self.wrapper = wrapper

    def _get(self, key: str, inherit: bool = False, wrapper_first: bool = False) -> Any:
        if wrapper_first and key in self.wrapper:
            return self.wrapper[key]
        if key in self.text:
            return self.text[key]
        if inherit and key in self.wrapper:
            return self.wrapper[key]
        return None

    def integer(self, key: str, upper: int, default: int | None = None, lower: int = 1) -> int:
        value = self._get(key)
        if value is None:
            if default is None:
                raise GeometryError(f"config is missing {key!r} (an integer); copy it from the model's config.json")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise GeometryError(f"config key {key!r} must be an integer, got {value!r}")
        if not lower <= value <= upper:
            raise GeometryError(f"config key {key!r} = {value} is outside [{lower}, {upper}]")
        return value

    def number(self, key: str, default: float, inherit: bool = False) -> float:
        value = self._get(key, inherit)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise GeometryError(f"config key {key!r} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool, inherit: bool = False, wrapper_first: bool = False) -> bool:
        value = self._get(key, inherit, wrapper_first)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise GeometryError(f"config key {key!r} must be true or false, got {value!r}")
        return value

    def text_value(self, key: str, inherit: bool = False) -> str | None:
        value = self._get(key, inherit)
        if value is not None and not isinstance(value, str):
            raise GeometryError(f"config key {key!r} must be a string, got {value!r}")
        return value


def _model_type(text: dict, wrapper: dict) -> str:
    for where, config in (("config key 'model_type'", text), ("the wrapper config's 'model_type'", wrapper or {})):
        if config.get("model_type") is not None and not isinstance(config["model_type"], str):
            raise GeometryError(f"{where} must be a string, got {excerpt(config['model_type'])}")
    model_type = text.get("model_type")
    if model_type is None and wrapper:
        model_type = _WRAPPER_TEXT_MODEL_TYPES.get(wrapper.get("model_type"))
    if model_type is None:
        raise GeometryError(
            f"config is missing 'model_type'; hybridkv sizes {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(or a qwen3_5 / qwen3_5_moe wrapper with text_config)"
        )
    model_type = _WRAPPER_TEXT_MODEL_TYPES.get(model_type, model_type)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise GeometryError(
            f"model_type {model_type!r} is not a hybrid Gated DeltaNet model hybridkv can size; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def _layer_types(read: _Reader, num_layers: int) -> tuple[str, ...]:
    raw = read.text.get("layer_types")
    if raw is None:
        interval = read.integer("full_attention_interval", num_layers, default=_DEFAULT_FULL_ATTENTION_INTERVAL)
        return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers))
    if not isinstance(raw, list) or len(raw) != num_layers:
        raise GeometryError(f"config key 'layer_types' must be a list of num_hidden_layers ({num_layers}) entries")
    for kind in raw:
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise GeometryError(
                f"config key 'layer_types' has {kind!r}; each entry must be {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}"
            )
    return tuple(raw)


def _rope(read: _Reader) -> tuple[float, float]:
    params = read.text.get("rope_parameters") or read.text.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise GeometryError("config key 'rope_parameters' must be an object")
    inner = _Reader(params, read.text)
    theta = inner.number("rope_theta", _DEFAULT_ROPE_THETA, inherit=True)
    factor = inner.number("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY_FACTOR, inherit=True)
    if factor > 1:
        raise GeometryError(f"config key 'partial_rotary_factor' = {factor} must be in (0, 1]")
    return theta, factor


MAX_CONFIG_FILE_BYTES = 1_048_576  # a model's config.json is a few KB; anything this large is not one


def read_config_file(path: str) -> dict:
    """A Hugging Face config.json (or any JSON object of that kind) from disk, bounded in size."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as exc:
        raise GeometryError(f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise GeometryError(f"{path} is larger than {MAX_CONFIG_FILE_BYTES} bytes; pass a model's config.json")
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GeometryError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise GeometryError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def geometry_from_config(config: dict, name: str | None = None) -> ModelGeometry:
    """Parse a Hugging Face config.json object into a ModelGeometry; GeometryError names the bad or missing key."""
    text, wrapper = _text_config(config)
    model_type = _model_type(text, wrapper)
    read = _Reader(text, wrapper)
    num_layers = read.integer("num_hidden_layers", MAX_LAYERS)
    layer_types = _layer_types(read, num_layers)
    if FULL_ATTENTION not in layer_types or LINEAR_ATTENTION not in layer_types:
        raise GeometryError(
            "layer_types must mix 'linear_attention' and 'full_attention' layers; "
            "hybridkv serves hybrid models, and this config has only one kind"
        )
    num_heads = read.integer("num_attention_heads", MAX_HEADS)
    num_kv_heads = read.integer("num_key_value_heads", MAX_HEADS)
    if num_heads % num_kv_heads:
        raise GeometryError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    k_heads = read.integer("linear_num_key_heads", MAX_HEADS)
    v_heads = read.integer("linear_num_value_heads", MAX_HEADS)
    if v_heads % k_heads:
        raise GeometryError(
            f"linear_num_value_heads ({v_heads}) must be a multiple of linear_num_key_heads ({k_heads})"
        )
    moe: dict[str, Any] = {}
    experts = read.integer("num_experts", MAX_EXPERTS, default=0, lower=0) if model_type != "qwen3_5_text" else 0
    if model_type == "qwen3_5_moe_text" and experts == 0:
        raise GeometryError("config is missing 'num_experts' (an integer); qwen3_5_moe_text is a MoE model")
    if experts:
        moe = {
            "num_experts": experts,
            "num_experts_per_tok": read.integer("num_experts_per_tok", experts),
            "moe_intermediate_size": read.integer("moe_intermediate_size", MAX_INTERMEDIATE_SIZE),
            "shared_expert_intermediate_size": read.integer(
                "shared_expert_intermediate_size", MAX_INTERMEDIATE_SIZE, default=0, lower=0
            ),
            "norm_topk_prob": read.flag("norm_topk_prob", True),
        }
        if model_type == "qwen3_next":
            mlp_only = text.get("mlp_only_layers") or []
            if not isinstance(mlp_only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in mlp_only
            ):
                raise GeometryError(f"config key 'mlp_only_layers' must list layer indices in [0, {num_layers})")
            moe["decoder_sparse_step"] = read.integer("decoder_sparse_step", num_layers, default=1)
            moe["mlp_only_layers"] = tuple(sorted(set(mlp_only)))
    # A dense MLP width is needed only when some layer is not a MoE layer.
    sparse_layers = _sparse_layer_ids(
        num_layers, experts, moe.get("decoder_sparse_step", 1), moe.get("mlp_only_layers", ())
    )
    needs_dense_mlp = len(sparse_layers) < num_layers
    intermediate = read.integer("intermediate_size", MAX_INTERMEDIATE_SIZE, default=None if needs_dense_mlp else 0,
                            lower=1 if needs_dense_mlp else 0)
    dtype_name = read.text_value("dtype", inherit=True) or read.text_value("torch_dtype", inherit=True) or "bfloat16"
    ssm_dtype_name = read.text_value("mamba_ssm_dtype", inherit=True)
    rope_theta, partial_rotary_factor = _rope(read)
    hidden_act = read.text_value("hidden_act") or "silu"
    dtype = normalize_dtype(dtype_name, "config key 'dtype'")
    quantization = parse_quantization_config(read._get("quantization_config", inherit=True), dtype)
    return ModelGeometry(
        name=name or text.get("_name_or_path") or wrapper.get("_name_or_path") or model_type,
        model_type=model_type,
        hidden_size=read.integer("hidden_size", MAX_HIDDEN_SIZE),
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        vocab_size=read.integer("vocab_size", MAX_VOCAB_SIZE),
        intermediate_size=0 if not needs_dense_mlp else intermediate,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=read.integer("head_dim", MAX_HEAD_DIM),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=read.integer("linear_key_head_dim", MAX_HEAD_DIM),
        linear_value_head_dim=read.integer("linear_value_head_dim", MAX_HEAD_DIM),
        linear_conv_kernel_dim=read.integer("linear_conv_kernel_dim", MAX_CONV_KERNEL, lower=2),
        # A vision-language wrapper's own flag decides whether its LM head is tied (transformers reads it there).
        tie_word_embeddings=read.flag("tie_word_embeddings", False, inherit=True, wrapper_first=True),
        rms_norm_eps=read.number("rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
        rope_theta=rope_theta,
        partial_rotary_factor=partial_rotary_factor,
        max_position_embeddings=read.integer(
            "max_position_embeddings", MAX_POSITION_EMBEDDINGS, default=_DEFAULT_MAX_POSITION_EMBEDDINGS
        ),
        attn_output_gate=read.flag("attn_output_gate", True),
        attention_bias=read.flag("attention_bias", False),
        dtype=dtype,
        mamba_ssm_dtype=None if ssm_dtype_name is None else normalize_dtype(ssm_dtype_name, "mamba_ssm_dtype"),
        hidden_act=hidden_act,
        quantization=quantization,
        vision=None if wrapper.get("vision_config") is None else vision_from_config(
            wrapper["vision_config"], read.integer("hidden_size", MAX_HIDDEN_SIZE)
        ),
        **moe,
    )


# ---- the built-in catalog -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CatalogEntry:
    name: str
    display_name: str
    hf_ids: tuple[str, ...]
    config: dict
    guessed: tuple[str, ...]
    vision_config: dict | None = None


@cache
def _catalog() -> dict[str, CatalogEntry]:
    raw = json.loads(resources.files("hybridkv.sizing").joinpath("data/models.json").read_text())
    entries = {}
    for item in raw["models"]:
        entry = CatalogEntry(
            name=item["name"], display_name=item["display_name"], hf_ids=tuple(item["hf_ids"]),
            config=item["config"], guessed=tuple(item["guessed"]), vision_config=item.get("vision_config"),
        )
        entries[entry.name] = entry
    return entries


@cache
def _lookup_keys() -> dict[str, str]:
    keys = {}
    for entry in _catalog().values():
        for key in (entry.name, entry.display_name, *entry.hf_ids):
            keys[key.lower()] = entry.name
    return keys


def catalog_names() -> list[str]:
    return list(_catalog())


def catalog_entry(name: str) -> CatalogEntry:
    """The catalog entry for a catalog name ("qwen3.5-4b") or a Hugging Face id ("Qwen/Qwen3.5-4B")."""
    key = _lookup_keys().get(str(name).strip().lower())
    if key is None:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(catalog_names())} "
            "(or give the model's config.json)"
        )
    return _catalog()[key]


def is_catalog_model(name: str) -> bool:
    return str(name).strip().lower() in _lookup_keys()


@cache
def catalog_geometry(name: str) -> ModelGeometry:
    entry = catalog_entry(name)
    geometry = geometry_from_config(entry.config, name=entry.display_name)
    if entry.vision_config is None:
        return geometry
    return replace(geometry, vision=vision_from_config(entry.vision_config, geometry.hidden_size))
