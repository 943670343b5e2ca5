from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logprobs", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "stopping", "cache_salt", "resume_tail_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TAIL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    stopping: StoppingCriteria
    cache_salt: str
    resume_tail_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., cache_salt: _Optional[str] = ..., resume_tail_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finished", "finish_reason", "usage", "logprobs", "times")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    times: RequestTimes
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., times: _Optional[_Union[RequestTimes, _Mapping]] = ...) -> None: ...

class RequestTimes(_message.Message):
    __slots__ = ("time_to_first_token_s", "queue_s", "prefill_s", "decode_s")
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    def __init__(self, time_to_first_token_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ...) -> None: ...

class GetCapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankCapacity(_message.Message):
    __slots__ = ("block_size", "token_blocks", "token_capacity", "state_slots", "token_pool_bytes", "state_pool_bytes", "budget_bytes", "weights_bytes", "reserve_bytes", "checkpoint_slots", "checkpoint_pool_bytes")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    token_blocks: int
    token_capacity: int
    state_slots: int
    token_pool_bytes: int
    state_pool_bytes: int
    budget_bytes: int
    weights_bytes: int
    reserve_bytes: int
    checkpoint_slots: int
    checkpoint_pool_bytes: int
    def __init__(self, block_size: _Optional[int] = ..., token_blocks: _Optional[int] = ..., token_capacity: _Optional[int] = ..., state_slots: _Optional[int] = ..., token_pool_bytes: _Optional[int] = ..., state_pool_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ..., checkpoint_slots: _Optional[int] = ..., checkpoint_pool_bytes: _Optional[int] = ...) -> None: ...

class PredictedCapacity(_message.Message):
    __slots__ = ("weights_bytes", "reserve_bytes", "budget_bytes", "token_blocks", "token_capacity", "state_slots", "token_pool_bytes", "state_pool_bytes", "checkpoint_slots", "checkpoint_pool_bytes")
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    weights_bytes: int
    reserve_bytes: int
    budget_bytes: int
    token_blocks: int
    token_capacity: int
    state_slots: int
    token_pool_bytes: int
    state_pool_bytes: int
    checkpoint_slots: int
    checkpoint_pool_bytes: int
    def __init__(self, weights_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., token_blocks: _Optional[int] = ..., token_capacity: _Optional[int] = ..., state_slots: _Optional[int] = ..., token_pool_bytes: _Optional[int] = ..., state_pool_bytes: _Optional[int] = ..., checkpoint_slots: _Optional[int] = ..., checkpoint_pool_bytes: _Optional[int] = ...) -> None: ...

class CapacityUsage(_message.Message):
    __slots__ = ("used_token_blocks", "used_state_slots", "running", "waiting", "cached_token_blocks", "used_checkpoint_slots")
    USED_TOKEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    used_token_blocks: int
    used_state_slots: int
    running: int
    waiting: int
    cached_token_blocks: int
    used_checkpoint_slots: int
    def __init__(self, used_token_blocks: _Optional[int] = ..., used_state_slots: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., cached_token_blocks: _Optional[int] = ..., used_checkpoint_slots: _Optional[int] = ...) -> None: ...

class CapacityReport(_message.Message):
    __slots__ = ("block_size", "token_blocks", "token_capacity", "state_slots", "token_pool_bytes", "state_pool_bytes", "budget_bytes", "weights_bytes", "reserve_bytes", "tensor_parallel_size", "per_rank", "predicted", "usage", "checkpoint_slots", "checkpoint_pool_bytes", "checkpoint_attention_tokens")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ATTENTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    token_blocks: int
    token_capacity: int
    state_slots: int
    token_pool_bytes: int
    state_pool_bytes: int
    budget_bytes: int
    weights_bytes: int
    reserve_bytes: int
    tensor_parallel_size: int
    per_rank: _containers.RepeatedCompositeFieldContainer[RankCapacity]
    predicted: PredictedCapacity
    usage: CapacityUsage
    checkpoint_slots: int
    checkpoint_pool_bytes: int
    checkpoint_attention_tokens: int
    def __init__(self, block_size: _Optional[int] = ..., token_blocks: _Optional[int] = ..., token_capacity: _Optional[int] = ..., state_slots: _Optional[int] = ..., token_pool_bytes: _Optional[int] = ..., state_pool_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., per_rank: _Optional[_Iterable[_Union[RankCapacity, _Mapping]]] = ..., predicted: _Optional[_Union[PredictedCapacity, _Mapping]] = ..., usage: _Optional[_Union[CapacityUsage, _Mapping]] = ..., checkpoint_slots: _Optional[int] = ..., checkpoint_pool_bytes: _Optional[int] = ..., checkpoint_attention_tokens: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "model_type", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "vocab_size", "dtype", "ssm_dtype", "device", "tensor_parallel_size", "block_size", "eos_token_ids", "num_full_attention_layers", "num_linear_attention_layers", "cuda_graphs", "server_version", "startup_phases", "enable_prefix_caching")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SSM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FULL_ATTENTION_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LINEAR_ATTENTION_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTUP_PHASES_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_type: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    dtype: str
    ssm_dtype: str
    device: str
    tensor_parallel_size: int
    block_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_full_attention_layers: int
    num_linear_attention_layers: int
    cuda_graphs: bool
    server_version: str
    startup_phases: _containers.RepeatedCompositeFieldContainer[StartupPhase]
    enable_prefix_caching: bool
    def __init__(self, name: _Optional[str] = ..., model_type: _Optional[str] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., ssm_dtype: _Optional[str] = ..., device: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., block_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_full_attention_layers: _Optional[int] = ..., num_linear_attention_layers: _Optional[int] = ..., cuda_graphs: _Optional[bool] = ..., server_version: _Optional[str] = ..., startup_phases: _Optional[_Iterable[_Union[StartupPhase, _Mapping]]] = ..., enable_prefix_caching: _Optional[bool] = ...) -> None: ...

class StartupPhase(_message.Message):
    __slots__ = ("name", "seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    seconds: float
    def __init__(self, name: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
