"""Engine configuration and its start-up validation.

Every setting is checked before anything is loaded, so a bad flag costs nothing. Features the dual-pool cache does not
support yet (KV offload) are refused here: silently serving without them would misstate capacity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from hybridkv.errors import UserError
from hybridkv.sizing.memory import KV_CACHE_DTYPES
from hybridkv.sizing.prediction import DEFAULT_PIECEWISE_GRAPH_TOKENS
from hybridkv.sizing.prefix import DEFAULT_CHECKPOINT_INTERVAL_TOKENS
from hybridkv.sizing.spec import MAX_TARGET_TPOT_MS

# On CPU there is no device memory to measure; without --kv-cache-memory the pools get this fixed budget.
DEFAULT_CPU_KV_CACHE_MEMORY_BYTES = 64 * 1024**2

MAX_NUM_SEQS_LIMIT = 65536
MAX_BLOCK_SIZE = 256
MAX_NUM_BATCHED_TOKENS_LIMIT = 1 << 20
MAX_CHECKPOINT_SLOTS = 65536
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
SSM_DTYPES = (None, "float32", "bfloat16", "float16")
# Where the weights come from: the folder's safetensors ("auto" is the same today), or seeded random values built in
# the model's own memory ("dummy" is vLLM's name for it).
LOAD_FORMATS = ("auto", "safetensors", "random")
LOAD_FORMAT_ALIASES = {"dummy": "random"}


# Seconds the engine may hold work without sending anything before the server's liveness fails: above a long prefill
# step and the first-call compiles of a new shape (`hybridkv serve --engine-stall-timeout`).
DEFAULT_STALL_TIMEOUT_S = 120.0


# Prefill held back while decodes run (`hybridkv serve --min-prefill-tokens-with-decodes`, --max-prefill-wait-steps).
DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES = 4096
# With prefix caching on most of a cached prompt needs no prefill: on the H200, holding for 4096 ready tokens rather
# than 1024 cost the cached chat workload 12% of its requests/s and raised TTFT p50 by 50% (chat) and 23%
# (documents; docs/performance.md).
DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES_CACHED = 1024
DEFAULT_MAX_PREFILL_WAIT_STEPS = 32
MAX_PREFILL_WAIT_STEPS_LIMIT = 1024


class ConfigError(UserError):
    """An engine setting that cannot work, with what to change."""


@dataclass
class EngineConfig:
    model: str
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    # Prefill tokens a step may run while decodes run in it (None: up to max_num_batched_tokens). A smaller budget
    # bounds a decode step's time under mixed load at the cost of slower prefill (docs/performance.md).
    max_prefill_tokens_with_decodes: int | None = None
    # While decodes run, prefill waits until this many prompt tokens are ready or it has waited max_prefill_wait_steps
    # steps (the scheduler's docstring says why). None: DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES where decode steps
    # replay CUDA graphs (DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES_CACHED with prefix caching on), else 0 (never
    # held); the defaults are read off measured rows (docs/performance.md).
    min_prefill_tokens_with_decodes: int | None = None
    max_prefill_wait_steps: int = DEFAULT_MAX_PREFILL_WAIT_STEPS
    # Time per output token the scheduler keeps decoding requests under by holding new prompts back while the recent
    # steps run longer (the scheduler's docstring); None: admission never waits on it.
    target_tpot_ms: float | None = None
    block_size: int = 16
    device: str = "auto"
    dtype: str = "auto"
    ssm_dtype: str | None = None
    kv_cache_dtype: str = "auto"  # "fp8": float8_e4m3fn pages with the checkpoint's per-layer K/V scales
    enforce_eager: bool = False
    # Mixed and prefill steps of up to this many tokens replay their token-wise work as CUDA graphs (0: eagerly).
    piecewise_cuda_graph_max_tokens: int = DEFAULT_PIECEWISE_GRAPH_TOKENS
    # Opt-in here, where benchmarks drive the engine with repeated prompts to time the steps themselves; `hybridkv
    # serve`, `hybridkv plan` and the HybridModel turn it on by default.
    enable_prefix_caching: bool = False
    prefix_checkpoint_slots: int | None = None  # None: the sizing default, a fraction of max_num_seqs
    prefix_checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL_TOKENS  # tokens; 0 checkpoints prompt ends only
    kv_offload: bool = False
    seed: int = 0
    load_format: str = "auto"

    def validate(self) -> None:
        """Raise ConfigError naming the first setting that cannot work; changes nothing."""
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.prefix_checkpoint_slots is not None:
            _check_int("prefix_checkpoint_slots", self.prefix_checkpoint_slots, 1, MAX_CHECKPOINT_SLOTS)
            if not self.enable_prefix_caching:
                raise ConfigError("--prefix-checkpoint-slots needs prefix caching on; drop --no-enable-prefix-caching")
        _check_int("prefix_checkpoint_interval", self.prefix_checkpoint_interval, 0, 1 << 24)
        if self.kv_offload:
            raise ConfigError("KV offload is not supported by the dual-pool cache yet; start without --kv-offload")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ConfigError(f"model folder {self.model!r} has no config.json; pass a folder with a checkpoint")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel_size()
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, 1 << 50)
        _check_int("max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS_LIMIT)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1, 1 << 24)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, MAX_NUM_BATCHED_TOKENS_LIMIT)
        _check_int("piecewise_cuda_graph_max_tokens", self.piecewise_cuda_graph_max_tokens, 0,
                   MAX_NUM_BATCHED_TOKENS_LIMIT)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs={self.max_num_seqs}: "
                "every running request must be able to decode in one step; raise it or lower max_num_seqs"
            )
        if self.max_prefill_tokens_with_decodes is not None:
            _check_int("max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes, 1,
                       self.max_num_batched_tokens)
        if self.min_prefill_tokens_with_decodes is not None:
            _check_int("min_prefill_tokens_with_decodes", self.min_prefill_tokens_with_decodes, 0,
                       self.max_num_batched_tokens)
        _check_int("max_prefill_wait_steps", self.max_prefill_wait_steps, 0, MAX_PREFILL_WAIT_STEPS_LIMIT)
        if self.target_tpot_ms is not None and (
                isinstance(self.target_tpot_ms, bool) or not isinstance(self.target_tpot_ms, (int, float))
                or not 0.0 < self.target_tpot_ms <= MAX_TARGET_TPOT_MS):
            raise ConfigError(f"target_tpot_ms must be a number of milliseconds in (0, {MAX_TARGET_TPOT_MS:g}], "
                              f"got {self.target_tpot_ms!r}")
        _check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.prefix_checkpoint_interval % self.block_size:
            raise ConfigError(
                f"prefix_checkpoint_interval={self.prefix_checkpoint_interval} must be a multiple of block_size="
                f"{self.block_size} (checkpoints sit on block boundaries); 0 checkpoints prompt ends only"
            )
        if not (self.device in ("auto", "cpu", "cuda") or (
                self.device.startswith("cuda:") and self.device[5:].isdigit() and self.device[5:].isascii())):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.ssm_dtype not in SSM_DTYPES:
            raise ConfigError(f"ssm_dtype must be one of float32, bfloat16, float16, got {self.ssm_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _check_int("seed", self.seed, 0, 2**63 - 1)

    def _geometry(self, checking: str):
        from hybridkv.sizing import GeometryError, geometry_from_config

        try:
            return geometry_from_config(self.read_model_config())
        except GeometryError as exc:
            raise ConfigError(f"cannot check {checking} against the model: {exc}") from exc

    def _check_tensor_parallel_size(self) -> None:
        """Every rank must hold whole heads: refuse a size that does not split them before anything starts."""
        from hybridkv.sizing import check_tensor_parallel_size

        geometry = self._geometry(f"tensor_parallel_size={self.tensor_parallel_size}")
        try:
            check_tensor_parallel_size(geometry, self.tensor_parallel_size)
        except UserError as exc:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size}: {exc}") from exc

    @property
    def checkpoint_slots(self) -> int:
        """Checkpoint slots of the prefix cache: 0 when it is off, else the flag or the sizing default."""
        from hybridkv.sizing import default_checkpoint_slots

        if not self.enable_prefix_caching:
            return 0
        return self.prefix_checkpoint_slots or default_checkpoint_slots(self.max_num_seqs)

    def read_model_config(self) -> dict:
        from hybridkv.sizing import read_config_file

        return read_config_file(os.path.join(self.model, "config.json"))

    def to_dict(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
