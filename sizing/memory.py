"""The byte model per tensor-parallel rank: what one token and one running request cost, and what tp is valid.

- `bytes_per_token = L_attn × 2 × kv_heads_per_rank × head_dim × kv_dtype_bytes` (K and V of every full-attention
  layer); KV heads are split when tp divides them and replicated (one per rank) when tp is a multiple of them.
- `conv_dim_per_rank = (2 × linear_k_heads × k_dim + linear_v_heads × v_dim) / tp`
- per GDN layer: conv state `(W − 1) × conv_dim_per_rank × conv_dtype_bytes` + recurrent state
  `(linear_v_heads / tp) × v_dim × k_dim × ssm_dtype_bytes`; `bytes_per_request = L_gdn × that`.
- dtypes: KV and conv state default to the model dtype; the recurrent state to the config's `mamba_ssm_dtype`
  (fp32 for Qwen3.5/3.6), else the model dtype (bf16 for Qwen3-Next), as vLLM does. An fp8 KV cache
  (`kv_cache_dtype("fp8", ...)`) stores one byte per element, so the same budget holds twice the bf16 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.sizing.errors import GeometryError, TensorParallelError
from hybridkv.sizing.geometry import ModelGeometry, dtype_bytes, normalize_dtype
from hybridkv.sizing.quantization import tensor_parallel_problems

# Largest tensor-parallel size considered: one replica never spans more GPUs than this.
MAX_TENSOR_PARALLEL_SIZE = 64
# Choices of the token pool's dtype (`--kv-cache-dtype`, serving.kvCacheDtype): "auto" keeps the model dtype, "fp8"
# stores e4m3 with one static scale for K and one for V per attention layer (the checkpoint's, else 1.0).
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV_DTYPE = "float8_e4m3fn"


def kv_cache_dtype(choice: str, model_dtype: str) -> str:
    """The token pool's dtype name for a kv-cache-dtype choice; GeometryError for anything but auto or fp8."""
    if choice not in KV_CACHE_DTYPES:
        raise GeometryError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {choice!r}")
    return normalize_dtype(model_dtype) if choice == "auto" else FP8_KV_DTYPE


@dataclass(frozen=True)
class PoolShapes:
    """Per-rank tensor shapes and dtypes of both pools, torch-free: the one statement of the pools' geometry.

    The engine's cache allocates exactly these tensors (attention K and V pages `[blocks, block_size, *kv_token_shape]`
    per full-attention layer; conv and recurrent state `[slots, *conv_slot_shape]` and `[slots, *ssm_slot_shape]` per
    GDN layer), and every byte figure below is derived from them.
    """

    num_full_attention_layers: int
    num_linear_attention_layers: int
    kv_token_shape: tuple[int, int]  # (kv_heads_per_rank, head_dim): one token of K (or V) in one layer
    conv_slot_shape: tuple[int, int]  # (conv_dim_per_rank, conv_kernel - 1)
    ssm_slot_shape: tuple[int, int, int]  # (v_heads_per_rank, v_dim, k_dim)
    kv_dtype: str
    conv_dtype: str
    ssm_dtype: str

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one attention layer."""
        return 2 * _product(self.kv_token_shape) * dtype_bytes(self.kv_dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.num_full_attention_layers * self.kv_bytes_per_token_per_layer

    @property
    def conv_state_bytes_per_layer(self) -> int:
        return _product(self.conv_slot_shape) * dtype_bytes(self.conv_dtype)

    @property
    def ssm_state_bytes_per_layer(self) -> int:
        return _product(self.ssm_slot_shape) * dtype_bytes(self.ssm_dtype)

    @property
    def bytes_per_request(self) -> int:
        return self.num_linear_attention_layers * (self.conv_state_bytes_per_layer + self.ssm_state_bytes_per_layer)

    @property
    def bytes_per_checkpoint(self) -> int:
        """A prefix-cache checkpoint holds the same conv and recurrent state tensors as one request's slot."""
        return self.bytes_per_request


def _product(shape: tuple[int, ...]) -> int:
    result = 1
    for extent in shape:
        result *= extent
    return result


@dataclass(frozen=True)
class RankBytes:
    """Per-rank bytes of one token of attention KV, one request's GDN state, and the weights."""

    tp: int
    kv_heads_per_rank: int
    head_dim: int
    bytes_per_token: int
    conv_dim_per_rank: int
    conv_state_bytes_per_layer: int
    ssm_state_bytes_per_layer: int
    bytes_per_request: int
    weights_bytes: int
    num_full_attention_layers: int
    num_linear_attention_layers: int
    kv_dtype: str
    conv_dtype: str
    ssm_dtype: str
    pool_shapes: PoolShapes

    @property
    def state_bytes_per_layer(self) -> int:
        """One request's conv + recurrent state in one GDN layer (vLLM's unpadded state page)."""
        return self.conv_state_bytes_per_layer + self.ssm_state_bytes_per_layer

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one attention layer (vLLM's per-token attention page size)."""
        return self.bytes_per_token // self.num_full_attention_layers


def _tp_problems(geometry: ModelGeometry, tp: int) -> list[str]:
    """Why `tp` cannot split this model's heads and channels evenly (empty when it can)."""
    problems = []
    divisors = [
        ("attention query heads", geometry.num_attention_heads),
        ("GDN key heads", geometry.linear_num_key_heads),
        ("GDN value heads", geometry.linear_num_value_heads),
        ("MLP channels (intermediate_size)", geometry.intermediate_size),
        ("expert channels (moe_intermediate_size)", geometry.moe_intermediate_size),
        ("shared-expert channels", geometry.shared_expert_intermediate_size),
    ]
    for what, count in divisors:
        if count and count % tp:
            problems.append(f"tp={tp} does not divide the {count} {what}")
    kv_heads = geometry.num_key_value_heads
    if kv_heads % tp and tp % kv_heads:
        problems.append(
            f"tp={tp} neither divides the {kv_heads} KV heads nor is a multiple of them (to replicate them)"
        )
    if geometry.quantization is not None:
        problems += tensor_parallel_problems(geometry, geometry.quantization, tp)
    return problems


def valid_tensor_parallel_sizes(geometry: ModelGeometry, max_tp: int = 8) -> list[int]:
    """Every tp in [1, max_tp] that splits the model evenly, ascending."""
    return [tp for tp in range(1, min(max_tp, MAX_TENSOR_PARALLEL_SIZE) + 1) if not _tp_problems(geometry, tp)]


def check_tensor_parallel_size(geometry: ModelGeometry, tp: int) -> None:
    """Raise TensorParallelError saying why `tp` is not valid for this model; return None when it is."""
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE:
        raise TensorParallelError(
            f"tensor-parallel size must be an integer in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {tp!r}"
        )
    problems = _tp_problems(geometry, tp)
    if problems:
        valid = ", ".join(map(str, valid_tensor_parallel_sizes(geometry, MAX_TENSOR_PARALLEL_SIZE)))
        raise TensorParallelError(f"{geometry.name}: {'; '.join(problems)}; valid tp: {valid}")


def byte_model(
    geometry: ModelGeometry,
    tp: int = 1,
    kv_dtype: str | None = None,
    conv_dtype: str | None = None,
    ssm_dtype: str | None = None,
) -> RankBytes:
    """Bytes one rank holds per token, per running request and for the weights, at tensor-parallel size `tp`."""
    check_tensor_parallel_size(geometry, tp)
    kv_dtype = normalize_dtype(kv_dtype or geometry.dtype, "kv dtype")
    conv_dtype = normalize_dtype(conv_dtype or geometry.dtype, "conv state dtype")
    ssm_dtype = normalize_dtype(ssm_dtype or geometry.default_ssm_dtype, "ssm state dtype")
    kv_heads_per_rank = max(1, geometry.num_key_value_heads // tp)
    shapes = PoolShapes(
        num_full_attention_layers=geometry.num_full_attention_layers,
        num_linear_attention_layers=geometry.num_linear_attention_layers,
        kv_token_shape=(kv_heads_per_rank, geometry.head_dim),
        conv_slot_shape=(geometry.conv_dim // tp, geometry.linear_conv_kernel_dim - 1),
        ssm_slot_shape=(geometry.linear_num_value_heads // tp, geometry.linear_value_head_dim,
                        geometry.linear_key_head_dim),
        kv_dtype=kv_dtype,
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
    )
    return RankBytes(
        tp=tp,
        kv_heads_per_rank=kv_heads_per_rank,
        head_dim=geometry.head_dim,
        bytes_per_token=shapes.bytes_per_token,
        conv_dim_per_rank=shapes.conv_slot_shape[0],
        conv_state_bytes_per_layer=shapes.conv_state_bytes_per_layer,
        ssm_state_bytes_per_layer=shapes.ssm_state_bytes_per_layer,
        bytes_per_request=shapes.bytes_per_request,
        weights_bytes=geometry.weights_bytes(tp),
        num_full_attention_layers=geometry.num_full_attention_layers,
        num_linear_attention_layers=geometry.num_linear_attention_layers,
        kv_dtype=kv_dtype,
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
        pool_shapes=shapes,
    )
