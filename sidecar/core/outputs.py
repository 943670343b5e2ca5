"""What the engine hands back: per-step request outputs, finished completions and stats snapshots.

Torch-free, because these cross into the server process, which unpickles them without loading the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability under the model, and the most likely ids at its position (most likely
    first) with theirs."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where a finished request's time in the engine went, as vLLM's request histograms split it (seconds on the
    engine process's monotonic clock): waiting to be scheduled, its prompt up to the host reading its first token,
    and its remaining tokens."""

    queue_s: float  # added -> first scheduled
    prefill_s: float  # first scheduled -> first token
    decode_s: float  # first token -> last token

    @property
    def inference_s(self) -> float:
        """First scheduled -> last token: the time the engine worked on it."""
        return self.prefill_s + self.decode_s


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens taken from the prefix cache at the request's first admission (their KV and GDN state reused).
    cached_tokens: int = 0
    # One entry per new token when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # On a request's final output, once it had a first token: where its time in the engine went.
    timings: RequestTimings | None = None
    # Set by the serving frontend on the same final output: from its taking the request to the first token.
    time_to_first_token_s: float | None = None

    def __reduce__(self):
        # Every running request's output crosses the engine's pipe every step: its fields in order pickle and load
        # in about half the time of a slots dataclass's default state (a dict of the slots, built per object).
        return RequestOutput, (self.request_id, self.new_token_ids, self.text_delta, self.finished, self.finish_reason,
                               self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.logprobs,
                               self.timings, self.time_to_first_token_s)


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # one entry per token when the request asked for logprobs
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache


# A step runs only decodes (one token per request: the CUDA-graph path), only prefill chunks, or both.
STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(num_decodes: int, num_seqs: int) -> str:
    if num_decodes == num_seqs:
        return "decode"
    return "prefill" if num_decodes == 0 else "mixed"


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    used_token_blocks: int
    total_token_blocks: int
    used_state_slots: int
    total_state_slots: int
    preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Triton kernels compiled in the engine's process since ready: a shape the start-up warm-up missed.
    jit_compiles_after_ready_total: int = 0
    # Steps that held waiting prompts back while requests decoded (`min_prefill_tokens_with_decodes`).
    prefill_held_steps_total: int = 0
    # Steps that admitted no waiting prompt because the recent steps ran over the TPOT target (`target_tpot_ms`).
    tpot_held_steps_total: int = 0
    # Prefix caching (all zero while it is off): blocks kept for reuse, checkpoints held, tokens looked up and found.
    cached_token_blocks: int = 0
    used_checkpoint_slots: int = 0
    total_checkpoint_slots: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefix_cache_hits_by_kind: dict = field(default_factory=dict)
    # Steps a waiting request waited for a prefix another request was computing (it then resumed there).
    shared_prefix_waits_total: int = 0
    # Engine steps launched by kind (STEP_KINDS), the seconds its loop spent in them, and of those the seconds it
    # waited for the device: a small share means the host, not the device, set the pace.
    steps_by_kind_total: dict = field(default_factory=dict)
    step_seconds_total: float = 0.0
    device_wait_seconds_total: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)
