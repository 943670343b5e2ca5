"""Per-request sampling parameters and their validation (torch-free, so the gRPC layer can check requests cheaply)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridkv.errors import UserError, excerpt

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_K = 1 << 20
MAX_REQUEST_ID_CHARS = 256
# The most alternatives a request may ask logprobs for (OpenAI's own limit for top_logprobs).
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0
# A repetition penalty divides logits by it: below this it would push float32 logits to infinity.
MIN_REPETITION_PENALTY = 0.01
# Temperatures below this sample as greedy (as vLLM does): dividing float32 logits by less overflows them.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_CACHE_SALT_CHARS = 256
# logit_bias: at most this many token ids, each biased by a value in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range:
# -100 bans a token, 100 makes it the only choice).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0


class RequestError(UserError):
    """A request the engine cannot run as asked, with the reason; `param` names the request field to fix where one
    does ("prompt", "max_tokens", a sampling field's name), for front doors that report it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    # Before this many tokens are generated, end-of-sequence and stop_token_ids are not sampled and stop strings do not
    # end the request (vLLM's min_tokens).
    min_tokens: int = 0
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    # Keep the stop string that ended the request at the end of its text (vLLM's include_stop_str_in_output).
    include_stop_str_in_output: bool = False
    # Subtracted from a token's logit once if it appears in the output so far (OpenAI's presence_penalty).
    presence_penalty: float = 0.0
    # Subtracted from a token's logit per appearance in the output so far (OpenAI's frequency_penalty).
    frequency_penalty: float = 0.0
    # Divides positive and multiplies negative logits of tokens in the prompt or output; 1 disables it.
    repetition_penalty: float = 1.0
    # Drop tokens whose probability is below min_p times the most likely token's; 0 disables it.
    min_p: float = 0.0
    # Return each token's logprob and this many most likely alternatives; None returns no logprobs.
    logprobs: int | None = None
    cache_salt: str | None = None  # prefix-cache entries are shared only between requests with the same salt
    # The prompt's last tokens the conversation's next turn will not send again: a chat template's generation prompt
    # that renders the reply differently once it is history (Qwen's opens a `<think>` block that earlier replies lose).
    # Set by the chat endpoint. With prefix caching the request's prompt-end checkpoint goes before them and is kept
    # while it runs, and it takes no output-end checkpoint (the next turn resumes from the prompt end).
    resume_tail_tokens: int = 0
    # Added to these token ids' logits before sampling, (token id, bias) pairs (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = field(default=())

    def __post_init__(self):
        # Callers pass lists from JSON or protobuf; keep the object hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(tuple(pair) if isinstance(pair, (list, tuple)) else pair
                                                     for pair in bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    def min_tokens_banned_ids(self, eos_token_ids) -> tuple[int, ...]:
        """The ids not sampled before `min_tokens`: the stop token ids, and end-of-sequence unless it is ignored."""
        if not self.min_tokens:
            return ()
        return tuple(sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))))

    @property
    def penalized(self) -> bool:
        """The logits depend on the tokens seen so far, so the sampler keeps counts for this request."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, max_model_len: int, prompt_len: int, vocab_size: int | None = None) -> None:
        """Raise RequestError with the reason if this request cannot run within `max_model_len`."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if prompt_len < 1:
            raise RequestError("the prompt is empty; send at least one token")
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got "
                               f"{excerpt(self.min_tokens)}", "min_tokens")
        if prompt_len + self.max_tokens > max_model_len:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) = {prompt_len + self.max_tokens} "
                f"exceeds max_model_len {max_model_len}; shorten the prompt or lower max_tokens",
                "prompt" if prompt_len >= max_model_len else "max_tokens")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {excerpt(self.temperature)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {excerpt(self.top_p)}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {excerpt(getattr(self, name))}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise RequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {excerpt(value)}")
        if not _is_number(self.repetition_penalty) or not (
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise RequestError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                               f"{MAX_REPETITION_PENALTY:g}] (1 disables it), got {excerpt(self.repetition_penalty)}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {excerpt(self.min_p)}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives to "
                               f"return per token), got {excerpt(self.logprobs)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2^63), got {excerpt(self.seed)}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise RequestError(f"cache_salt must be a string of 1..{MAX_CACHE_SALT_CHARS} characters, got "
                               f"{excerpt(self.cache_salt)}")
        if (isinstance(self.resume_tail_tokens, bool) or not isinstance(self.resume_tail_tokens, int)
                or not 0 <= self.resume_tail_tokens < prompt_len):
            raise RequestError(f"resume_tail_tokens must be an integer in [0, {prompt_len}) (tokens of the "
                               f"{prompt_len}-token prompt), got {excerpt(self.resume_tail_tokens)}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for stop in self.stop:
            if not isinstance(stop, str) or not 0 < len(stop) <= MAX_STOP_STRING_CHARS:
                raise RequestError(f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters, got {excerpt(stop)}")
        self._validate_logit_bias(vocab_size)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0 or (
                vocab_size is not None and token_id >= vocab_size
            ):
                raise RequestError(f"stop token id {token_id!r} is not in the vocabulary")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise RequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got "
                               f"{len(self.logit_bias)}")
        seen = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise RequestError(f"logit_bias must map token ids to biases, got {excerpt(pair)}")
            token_id, bias = pair
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0 or (
                vocab_size is not None and token_id >= vocab_size
            ) or token_id in seen:
                reason = "is given twice" if token_id in seen else "is not in the vocabulary"
                raise RequestError(f"logit_bias token id {excerpt(token_id)} {reason}")
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias of token {token_id} must be in [-{MAX_LOGIT_BIAS:g}, "
                                   f"{MAX_LOGIT_BIAS:g}], got {excerpt(bias)}")
            seen.add(token_id)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                     vocab_size: int) -> None:
    """Raise RequestError with the reason if the engine cannot run this request (the engine and the server share it)."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise RequestError(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters")
    if not isinstance(params, SamplingParams):
        raise RequestError("params must be a SamplingParams")
    params.validate(max_model_len, len(prompt_token_ids), vocab_size)
    for token_id in prompt_token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise RequestError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab_size})", "prompt")
