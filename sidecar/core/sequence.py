"""One request's state as the scheduler and the cache manager see it (no tensors)."""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field

from hybridkv.sidecar.core.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt followed by the generated tokens the host has seen
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose attention KV and GDN state are in the pools
    # int64 token-pool blocks in order: the step's tensors copy them in one C-level extend (a list of Python ints
    # is converted one value at a time, which long contexts made a visible part of every step's host time).
    block_table: array = field(default_factory=lambda: array("q"))
    state_slot: int = 0  # 0 = holds no slot (slot 0 is the null slot)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Tokens already sampled on the device whose ids the host has not read yet (the engine launches step n+1 before
    # it reads step n's tokens). They count as tokens for scheduling; the model reads their ids on the device.
    num_pending_tokens: int = 0
    # Prefix caching (owned by the cache manager): the chained hash of each full block of known tokens, the checkpoints
    # launched steps write for this request whose key is not known yet, and the keys of its prompt-end checkpoint and
    # of its latest output checkpoint.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the cache by hash
    branch_tokens: int = 0  # where the prompt leaves blocks other requests cached: a checkpoint boundary
    shared_tokens: int = 0  # where a waiting request's prompt leaves this one's: a checkpoint boundary it waits for
    pending_checkpoints: list = field(default_factory=list)
    prompt_checkpoint_key: bytes | None = None
    pinned_checkpoint_key: bytes | None = None  # the prompt-end checkpoint it keeps from eviction while it runs
    output_checkpoint_key: bytes | None = None
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    # Monotonic seconds: added to the engine, first scheduled (kept through preemptions), first token read.
    arrival_s: float = field(default_factory=time.monotonic)
    scheduled_s: float | None = None
    first_token_s: float | None = None

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the request has, pending ones included: what scheduling and the pools reason about."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens the host has seen (what usage and outputs report)."""
        return len(self.token_ids) - self.num_prompt_tokens

    def at_length_limit(self, max_model_len: int, *, count_pending: bool = True) -> bool:
        """max_tokens or max_model_len is reached: counting pending tokens, the request needs no further step;
        counting only the tokens the host has seen, it is finished."""
        num_tokens = self.num_tokens if count_pending else len(self.token_ids)
        return num_tokens - self.num_prompt_tokens >= self.params.max_tokens or num_tokens >= max_model_len

    def stops_on(self, token_id: int, eos_token_ids: tuple[int, ...]) -> bool:
        """The next token ends the request by its id: a stop token id, or end-of-sequence unless eos is ignored, once
        `min_tokens` tokens came before it."""
        if self.num_completion_tokens < self.params.min_tokens:
            return False
        return token_id in self.params.stop_token_ids or (not self.params.ignore_eos and token_id in eos_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at `seq.num_computed_tokens`, run in this step."""

    seq: Sequence
    num_tokens: int
    fresh_slot: bool = False  # the scheduler assigned seq's state slot for this chunk: it must start at zero
    restore: tuple[int, int] | None = None  # (checkpoint slot, state slot): the slot starts from a cached prefix
    save: tuple[int, int] | None = None  # (state slot, checkpoint slot): the state after this chunk is checkpointed
    # ((tokens into the chunk, checkpoint slot), ...): the state there is checkpointed while the chunk runs
    captures: tuple[tuple[int, int], ...] = ()

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last logits give the next token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens
