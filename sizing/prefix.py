"""Replay a workload with shared prefixes through each allocator's prefix cache, on the same budget.

A token trace is JSONL, one request per line, with the token ids of its prompt and of its reply (the reply's ids are
what the next turn of a chat resends) and an optional `cache_salt` (requests with different salts never share):

    {"arrival_step": 0, "prompt_ids": [151644, 8948, ...], "output_ids": [...], "cache_salt": "tenant-a"}

The replay follows `hybridkv.sizing.simulate`'s step rules (first come first served, one token per running request per
step, the newest request preempted when no unit is free); what prefix caching changes is what a request holds. Cached
content is kept in `cache_block_tokens`-token entries keyed by a hash chained over the blocks before them; an entry
no running request holds stays on an LRU list, and an allocation evicts the least recently released entry only when
no unit is free. Each allocator's cache:

- **hybridkv dual pool**: 16-token blocks; GDN state lives in a checkpoint pool of its own slots (taken out of the
  budget before the token blocks, LRU-evicted), taken where the engine takes them: for the prompt's last block
  boundary, every checkpoint interval inside it and where a prompt leaves blocks another request cached, at the last
  64-token chunk start of the prompt's prefill (from where it resumed) at or before each, or on the boundary where
  the prefill ends there; and the reply's last block boundary. A request resumes from the longest prefix with both
  blocks and a checkpoint.
- **vLLM 0.33, align mode**: its raised block (576 tokens for Qwen3.5-4B/9B on an H200); every cached full block
  keeps a state page at its boundary (its GDN groups' pages, from the same pool), so hits land only on its block
  boundaries; a running request still pins its live and checkpoint state pages.
- **ideal bound**: an unbounded cache at token granularity: every token a request resends after another request
  with the same salt computed it is a hit. The cache costs nothing and its hits share no memory (each running request
  holds its own tokens, as in the plain replay), so it bounds the others' hits, not their memory.

Hit figures count each request's first admission (a preempted request's recompute hits too, but is not a new
query): hit-token fraction = prompt tokens found cached / prompt tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

from hybridkv.sizing.allocators import VLLM_0_20_NONE, PoolModel, pool_model
from hybridkv.sizing.errors import WorkloadError
from hybridkv.sizing.memory import RankBytes
from hybridkv.sizing.simulate import (
    MAX_ARRIVAL_STEP,
    MAX_REQUEST_TOKENS,
    MAX_TRACE_REQUESTS,
    decode_step,
    read_trace,
    trace_objects,
    write_trace,
)

MAX_TOKEN_ID = 2**31 - 1
MAX_SALT_CHARS = 256
# With prefix caching on, a long prompt is also checkpointed every this many tokens (besides its last block boundary),
# in the engine (`hybridkv serve --prefix-checkpoint-interval`) and in the replay here.
DEFAULT_CHECKPOINT_INTERVAL_TOKENS = 2048
# The GDN prefill's chunk length: a checkpoint inside a prefill chunk is taken at one of the chunk's 64-token chunk
# starts (the state pass holds the state there unrounded), so it sits a multiple of this after where the chunk began.
PREFILL_CHUNK_TOKENS = 64
# A request waits for a prefix a request still prefilling will checkpoint when that saves it at least this many prompt
# tokens, and the one prefilling checkpoints where a waiting prompt that far along parts from it (the engine's
# scheduler, and the dual pool's replay here).
SHARED_PREFIX_WAIT_TOKENS = 512
# A checkpoint is protected from eviction from its this-many-th use after it was taken (`SegmentedLru`).
PROTECTED_FROM_USE = 2
# Token ids the synthetic generators draw from (about a Qwen vocabulary).
SYNTHETIC_VOCAB = 150_000
PROMPT_END, INSIDE_PROMPT, OUTPUT_END = "prompt_end", "inside_prompt", "output_end"
CHECKPOINT_KINDS = (PROMPT_END, INSIDE_PROMPT, OUTPUT_END)


@dataclass(frozen=True)
class TokenRequest:
    arrival_step: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    cache_salt: str | None = None
    # The prompt's last tokens the conversation's next turn does not send again (a client re-rendering its history
    # through a chat template: the engine's `SamplingParams.resume_tail_tokens`).
    resume_tail_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def to_dict(self) -> dict:
        data = {"arrival_step": self.arrival_step, "prompt_ids": list(self.prompt_ids),
                "output_ids": list(self.output_ids)}
        if self.cache_salt is not None:
            data["cache_salt"] = self.cache_salt
        if self.resume_tail_tokens:
            data["resume_tail_tokens"] = self.resume_tail_tokens
        return data


def _token_ids(item: dict, key: str, where: str) -> tuple[int, ...]:
    ids = item.get(key)
    if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_REQUEST_TOKENS:
        raise WorkloadError(f"{where}: {key} must be a list of 1 to {MAX_REQUEST_TOKENS} token ids")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise WorkloadError(f"{where}: {key} holds {token!r}; token ids are integers in [0, {MAX_TOKEN_ID}]")
    return tuple(ids)


def parse_token_trace(lines, source: str = "<trace>") -> list[TokenRequest]:
    """Parse JSONL token-trace lines; WorkloadError names the line. Requests are ordered by arrival (stable)."""
    requests = []
    keys = {"arrival_step", "prompt_ids", "output_ids", "cache_salt", "resume_tail_tokens", "id"}
    hint = "; a prefix-caching trace gives prompt_ids and output_ids"
    for where, item in trace_objects(lines, source, keys, hint):
        arrival = item.get("arrival_step")
        if isinstance(arrival, bool) or not isinstance(arrival, int) or not 0 <= arrival <= MAX_ARRIVAL_STEP:
            raise WorkloadError(f"{where}: arrival_step must be an integer in [0, {MAX_ARRIVAL_STEP}], got {arrival!r}")
        salt = item.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_SALT_CHARS):
            raise WorkloadError(f"{where}: cache_salt must be a string of 1 to {MAX_SALT_CHARS} characters")
        prompt = _token_ids(item, "prompt_ids", where)
        tail = item.get("resume_tail_tokens", 0)
        if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail < len(prompt):
            raise WorkloadError(f"{where}: resume_tail_tokens must be an integer in [0, {len(prompt)}) (tokens of "
                                f"the prompt), got {tail!r}")
        requests.append(TokenRequest(arrival, prompt, _token_ids(item, "output_ids", where), salt, tail))
        if len(requests) > MAX_TRACE_REQUESTS:
            raise WorkloadError(f"{source} has more than {MAX_TRACE_REQUESTS} requests")
    if not requests:
        raise WorkloadError(f"{source} holds no requests")
    return sorted(requests, key=lambda r: r.arrival_step)


def read_token_trace(path: str | Path) -> list[TokenRequest]:
    return read_trace(path, parse_token_trace)


def write_token_trace(requests: list[TokenRequest], path: str | Path) -> None:
    write_trace(requests, path)


# ---- synthetic workloads with shared prefixes -------------------------------------------------------------------------
def _check_positive(value: int, what: str, upper: int = MAX_REQUEST_TOKENS) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
        raise WorkloadError(f"{what} must be an integer in [1, {upper}], got {value!r}")


def _lengths(rng: random.Random, mean: int, sigma: float = 0.5) -> int:
    """A log-normal length of mean `mean` (σ = 0.5 unless given), at least 1."""
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))


def _ids(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(SYNTHETIC_VOCAB) for _ in range(count))


# A re-rendered chat's generation prompt: tokens each prompt ends with that its next turn does not send again (Qwen's
# `<think>` and the newline after it), in place of which it sends the reply as the template renders it.
RERENDERED_TAIL = (SYNTHETIC_VOCAB, SYNTHETIC_VOCAB + 1)


def multi_turn_workload(
    seed: int, conversations: int = 64, turns: int = 4, system_prompt_tokens: int = 2048,
    mean_user_tokens: int = 256, mean_output_tokens: int = 256, think_steps: int = 32, rerendered: bool = False,
    user_sigma: float = 0.5, output_sigma: float = 0.5, max_tokens: int | None = None,
) -> list[TokenRequest]:
    """Chats sharing one system prompt: turn k's prompt is the system prompt, every earlier user message and reply,
    and a new user message; it arrives `think_steps` after the previous turn could have finished (its output length
    in steps after its arrival). Conversations start at once, as the serving benchmark's multi-turn workload does.
    Message and reply lengths are log-normal with the given means and σ; with `max_tokens`, a conversation ends
    before a turn whose prompt and reply would not fit in it.

    `rerendered`: the client re-renders the history through a chat template, as the chat endpoint's clients do:
    each prompt ends with RERENDERED_TAIL (its `resume_tail_tokens`), and the next turn has in its place the reply
    written as the template renders it (other ids than those generated)."""
    for value, what in ((conversations, "conversations"), (turns, "turns"), (system_prompt_tokens, "the system prompt"),
                        (mean_user_tokens, "the mean user message"), (mean_output_tokens, "the mean reply")):
        _check_positive(value, what)
    rng = random.Random(seed)
    system = _ids(rng, system_prompt_tokens)
    tail = RERENDERED_TAIL if rerendered else ()
    requests = []
    for _ in range(conversations):
        history, arrival = system, 0
        for _ in range(turns):
            prompt = history + _ids(rng, _lengths(rng, mean_user_tokens, user_sigma))
            output = _ids(rng, _lengths(rng, mean_output_tokens, output_sigma))
            if max_tokens is not None and len(prompt) + len(tail) + len(output) > max_tokens:
                break
            requests.append(TokenRequest(arrival, prompt + tail, output, resume_tail_tokens=len(tail)))
            history = prompt + (tuple((token + 1) % SYNTHETIC_VOCAB for token in output) if rerendered else output)
            arrival += len(output) + think_steps
    return sorted(requests, key=lambda r: r.arrival_step)


def shared_document_workload(
    seed: int, documents: int = 8, questions_per_document: int = 16, document_tokens: int = 4096,
    mean_question_tokens: int = 64, mean_output_tokens: int = 128, arrivals_per_step: float = 1.0,
) -> list[TokenRequest]:
    """Questions about a few long documents: each prompt is one document and a new question, in random order with
    Poisson arrivals."""
    for value, what in ((documents, "documents"), (questions_per_document, "questions per document"),
                        (document_tokens, "the document"), (mean_question_tokens, "the mean question"),
                        (mean_output_tokens, "the mean reply")):
        _check_positive(value, what)
    rng = random.Random(seed)
    texts = [_ids(rng, document_tokens) for _ in range(documents)]
    order = [index for index in range(documents) for _ in range(questions_per_document)]
    rng.shuffle(order)
    requests, clock = [], 0.0
    for index in order:
        clock += rng.expovariate(arrivals_per_step)
        requests.append(TokenRequest(int(clock), texts[index] + _ids(rng, _lengths(rng, mean_question_tokens)),
                                     _ids(rng, _lengths(rng, mean_output_tokens))))
    return requests


# ---- block keys -----------------------------------------------------------------------------------------------------
def _salt_root(salt: str | None) -> int:
    """The key every chain starts from; different salts never share an entry."""
    return int.from_bytes(hashlib.sha256(b"hybridkv-prefix\0" + (salt or "").encode()).digest()[:8], "little")


def block_keys(ids: tuple[int, ...], block_tokens: int, salt: str | None) -> list[int]:
    """A key per full block of `ids`, each chained on the one before (a simulation key: 64-bit, not a content hash
    the engine could trust against collisions, which a replay does not need)."""
    keys, parent = [], _salt_root(salt)
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        parent = hash((parent, ids[start:start + block_tokens]))
        keys.append(parent)
    return keys


def shared_blocks(ours: Sequence, theirs: Sequence) -> int:
    """How many leading blocks two requests share, from their chained block keys (equal at block i means equal
    up to it, so by bisection): the engine's SHA-256 hashes and the replay's keys alike."""
    low, high = 0, min(len(ours), len(theirs))  # the first `low` blocks are the same
    while low < high:
        middle = (low + high + 1) // 2
        if ours[middle - 1] == theirs[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low


class SegmentedLru:
    """The eviction order of prefix-cache checkpoints (the engine's checkpoint pool and the replay here): a new key
    on probation, evicted first; one used `PROTECTED_FROM_USE` times since it was added, or added `protected`,
    moves to a protected list of at most `protected_limit` keys (three quarters of `capacity`, so at least a quarter
    stays for new keys to prove themselves in), whose least recently used key goes back to probation past that.
    Shared prefixes (a system prompt, a document) are used again and again and stay; a one-off prompt's end, or a
    chat turn's checkpoint that the next turn uses once and replaces with its own, leave first.

    A key can be pinned (a running request whose next turn re-renders its history keeps its prompt-end checkpoint):
    eviction passes over it until every pin is undone; at most `pin_limit` keys (half of `capacity`) are pinned, so
    new prompts can still be checkpointed."""

    def __init__(self, capacity: int):
        self.protected_limit = max(0, capacity - max(1, capacity // 4))
        self.pin_limit = capacity // 2
        self._probation: OrderedDict = OrderedDict()  # least recently used first
        self._protected: OrderedDict = OrderedDict()
        self._uses: dict = {}  # uses of keys on probation, where there were any
        self._pins: dict = {}  # pinned key -> how many hold it

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key) -> bool:
        return key in self._probation or key in self._protected

    @property
    def num_protected(self) -> int:
        return len(self._protected)

    @property
    def keys(self) -> list:
        """Every key, the next to be evicted first."""
        return [*self._probation, *self._protected]

    def add(self, key, protected: bool = False) -> None:
        if protected:
            self._protect(key)
        else:
            self._probation[key] = None

    def touch(self, key) -> None:
        """`key` was used again: most recently used, and protected from its PROTECTED_FROM_USE-th use."""
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        self._uses[key] = uses = self._uses.get(key, 0) + 1
        if uses < PROTECTED_FROM_USE:
            self._probation.move_to_end(key)
        else:
            del self._probation[key], self._uses[key]
            self._protect(key)

    def refresh(self, key) -> None:
        """`key` is wanted again soon (a finished request's checkpoints, which its next turn resumes from): most
        recently used on its own list, without counting a use."""
        (self._protected if key in self._protected else self._probation).move_to_end(key)

    def _protect(self, key) -> None:
        if not self.protected_limit:  # nothing to protect with: plain LRU
            self._probation[key] = None
            return
        self._protected[key] = None
        if len(self._protected) > self.protected_limit:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    @property
    def pins(self) -> dict:
        """Pinned keys and how many hold each."""
        return dict(self._pins)

    def pin(self, key) -> bool:
        """Keep `key` from eviction until as many `unpin`s; False (nothing pinned) when it is not here or
        `pin_limit` keys are pinned already."""
        if key not in self or (key not in self._pins and len(self._pins) >= self.pin_limit):
            return False
        self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def unpin(self, key) -> None:
        if self._pins[key] == 1:
            del self._pins[key]
        else:
            self._pins[key] -= 1

    def evict(self):
        """Remove and return the next key to evict that is not pinned, or None when none is left."""
        key = next((key for key in chain(self._probation, self._protected) if key not in self._pins), None)
        if key is not None:
            self.remove(key)
        return key

    def remove(self, key) -> None:
        (self._protected if key in self._protected else self._probation).pop(key)
        self._uses.pop(key, None)

    def problems(self) -> list[str]:
        """What breaks its invariants (none: an empty list)."""
        found = []
        if self._probation.keys() & self._protected.keys():
            found.append("a key is on both lists")
        if len(self._protected) > self.protected_limit:
            found.append(f"{len(self._protected)} protected keys, at most {self.protected_limit}")
        if not self._uses.keys() <= self._probation.keys():
            found.append("a use is counted for a key not on probation")
        if not all(key in self for key in self._pins) or len(self._pins) > self.pin_limit:
            found.append(f"{len(self._pins)} pinned keys, at most {self.pin_limit}, each one kept here")
        return found


# ---- the replay -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixCacheModel:
    """How one allocator caches prefixes on its pool."""

    pool: PoolModel
    cache_block_tokens: int  # tokens per cached entry (1 for the ideal bound)
    entry_state_units: int  # units of state each cached entry keeps besides its tokens (align mode's state pages)
    checkpoint_slots: int  # dual pool: GDN checkpoints in their own pool; 0: state is kept per entry or not at all
    checkpoint_interval_tokens: int = DEFAULT_CHECKPOINT_INTERVAL_TOKENS
    unbounded: bool = False  # the ideal bound: nothing is ever evicted and the cache costs no units

    @property
    def label(self) -> str:
        return self.pool.label


def prefix_cache_models(pools: dict[str, PoolModel], rank_bytes: RankBytes, checkpoint_slots: int,
                        checkpoint_interval_tokens: int = DEFAULT_CHECKPOINT_INTERVAL_TOKENS
                        ) -> dict[str, PrefixCacheModel]:
    """The prefix cache of every allocator in `pools` that has one (vLLM 0.20's none mode has none), keyed like
    `pools`; the dual pool's budget also holds `checkpoint_slots` checkpoints, taken out before its token blocks."""
    models = {}
    for key, pool in pools.items():
        layout = pool.allocator.layout
        if layout == "dual":
            pool = pool_model(pool.allocator, rank_bytes, pool.budget_bytes, pool.max_running, pool.block_size,
                              checkpoint_slots)
            models[key] = PrefixCacheModel(pool, pool.block_size, 0, checkpoint_slots, checkpoint_interval_tokens)
        elif layout == "shared" and key != VLLM_0_20_NONE.key:
            models[key] = PrefixCacheModel(pool, pool.block_size, pool.shared.gdn_groups, 0)
        elif layout == "ideal":
            models[key] = PrefixCacheModel(pool, 1, 0, 0, unbounded=True)
    return models


@dataclass
class PrefixReplayResult:
    allocator: str
    label: str
    cache_block_tokens: int
    steps: int = 0
    completed: int = 0
    refused: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_kind: dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0  # tokens computed at admission, recomputes included
    peak_cached_block_bytes: int = 0  # blocks holding cached content (shared by running requests or on the LRU)
    peak_checkpoint_bytes: int = 0  # GDN state kept for prefix reuse (checkpoints, or align mode's state pages)
    checkpoint_slots: int = 0
    unbounded_fraction: float | None = None  # hit tokens / the ideal bound's on the same trace
    invariant_checks: int = field(default=0, repr=False)

    @property
    def hit_fraction(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "allocator": self.allocator, "label": self.label, "cache_block_tokens": self.cache_block_tokens,
            "steps": self.steps, "completed": self.completed, "refused": self.refused,
            "preemptions": self.preemptions, "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
            "hit_fraction": round(self.hit_fraction, 4), "hit_tokens_by_kind": dict(self.hit_tokens_by_kind),
            "prefill_tokens": self.prefill_tokens, "peak_cached_block_bytes": self.peak_cached_block_bytes,
            "peak_checkpoint_bytes": self.peak_checkpoint_bytes, "checkpoint_slots": self.checkpoint_slots,
            "unbounded_fraction": None if self.unbounded_fraction is None else round(self.unbounded_fraction, 4),
        }


@dataclass
class _Live:
    request: TokenRequest
    index: int
    keys: list[int]  # the key of every full block of prompt + reply
    generated: int = 0
    shared: list[int] = field(default_factory=list)  # keys of the cached entries it holds, a prefix of `keys`
    private_blocks: int = 0  # blocks it holds that are not cached entries
    has_state: bool = False
    queried: bool = False
    prompt_key: int | None = None  # its prompt-end checkpoint's key (a re-rendered turn's next one resumes there)
    pinned: bool = False  # it keeps that checkpoint from eviction while it runs

    @property
    def context_tokens(self) -> int:
        return self.request.prompt_tokens + self.generated

    def ids(self, tokens: int) -> tuple[int, ...]:
        request = self.request
        return (request.prompt_ids + request.output_ids)[:tokens]


class _Replay:
    """One allocator's replay; owns the free units, the cached entries and the checkpoints."""

    def __init__(self, model: PrefixCacheModel, max_model_len: int):
        self.model = model
        self.pool = model.pool
        self.max_model_len = max_model_len
        self.block = model.cache_block_tokens
        self.entry_units = self.pool.units_per_block * (self.block // self.pool.block_size) + model.entry_state_units
        self.seen: set[int] = set()  # the ideal bound's cache: every key a request computed, never evicted
        self.free_units = self.pool.pool_units
        self.refs: dict[int, int] = {}  # cached entry -> running requests holding it
        self.lru: OrderedDict[int, None] = OrderedDict()  # entries no request holds, least recently released first
        self.checkpoints: dict[int, str] = {}  # boundary key -> kind
        self.checkpoint_order = SegmentedLru(model.checkpoint_slots)
        self.result = PrefixReplayResult(self.pool.allocator.key, self.pool.label, self.block,
                                         checkpoint_slots=model.checkpoint_slots)

    # --- units ---
    def _private_units(self, blocks: int) -> int:
        return 0 if blocks <= 0 else self.pool.units_for_request(blocks * self.block) - \
            self.pool.state_units_per_request

    def _take(self, units: int) -> bool:
        """Take `units` free units, evicting least recently released entries as needed."""
        while self.free_units < units and self.lru:
            key, _ = self.lru.popitem(last=False)
            del self.refs[key]
            self.free_units += self.entry_units
        if self.free_units < units:
            return False
        self.free_units -= units
        return True

    def _evictable(self, keep: list[int]) -> int:
        return self.free_units + self.entry_units * (len(self.lru) - sum(key in self.lru for key in keep))

    # --- prefix lookup ---
    def _needs_checkpoint(self) -> bool:
        return self.model.checkpoint_slots > 0

    def find(self, live: _Live) -> tuple[int, str | None, int]:
        """(cached blocks to resume from, the checkpoint kind there, blocks matched past it) for `live`."""
        usable = (live.context_tokens - 1) // self.block
        matched, best, kind = 0, 0, None
        cache = self.seen if self.model.unbounded else self.refs
        for key in live.keys[:usable]:
            if key not in cache:
                break
            matched += 1
            if not self._needs_checkpoint():
                best, kind = matched, None
            elif key in self.checkpoints:
                best, kind = matched, self.checkpoints[key]
        return best, kind, matched - best

    def _shared_with_waiting(self, live: _Live, waiting, start_tokens: int) -> int:
        """The longest prefix of `live`'s prompt a waiting request shares (its keys chain, so by bisection), where
        that is at least SHARED_PREFIX_WAIT_TOKENS past `start_tokens`; else 0. The waiting one keeps a token to run."""
        best = 0
        for other in waiting:
            if other is live:
                continue
            shared = shared_blocks(live.keys, other.keys) * self.block
            best = max(best, min(shared, (other.context_tokens - 1) // self.block * self.block))
        return best if best >= start_tokens + SHARED_PREFIX_WAIT_TOKENS else 0

    def admit(self, live: _Live, waiting=()) -> bool:
        """Admit `live` if its units fit; its prompt runs at once, its blocks and checkpoints (one also where a
        prompt in `waiting` parts from it) becoming visible to the requests admitted after it."""
        hit_blocks, kind, beyond = self.find(live)
        shared_blocks = 0 if self.model.unbounded else hit_blocks
        keep = live.keys[:shared_blocks]
        total_blocks = -(-(live.context_tokens + 1) // self.block)
        units = self.pool.state_units_per_request + self._private_units(total_blocks - shared_blocks)
        if self._evictable(keep) < units:
            return False
        for key in keep:  # off the LRU first, so the allocation below cannot evict them
            self.lru.pop(key, None)
            self.refs[key] += 1
        if not self._take(units):
            raise AssertionError("admission checked the units it takes")
        live.shared, live.private_blocks, live.has_state = list(keep), total_blocks - shared_blocks, True
        hit_tokens = hit_blocks * self.block
        if self._needs_checkpoint() and hit_blocks:
            self.checkpoint_order.touch(live.keys[hit_blocks - 1])
        self.result.prefill_tokens += live.context_tokens - hit_tokens
        if not live.queried:
            live.queried = True
            self.result.prompt_tokens += live.request.prompt_tokens
            self.result.hit_tokens += hit_tokens
            if hit_tokens:
                label = kind or "block"
                self.result.hit_tokens_by_kind[label] = self.result.hit_tokens_by_kind.get(label, 0) + hit_tokens
        self._register(live, live.context_tokens)
        if self._needs_checkpoint():
            shared = self._shared_with_waiting(live, waiting, hit_tokens)
            self._prompt_checkpoints(live, hit_blocks, (hit_blocks + beyond) * self.block, shared)
        return True

    def _checkpoint(self, key: int, kind: str, shared: bool = False) -> bool:
        """Take a checkpoint (`shared`: where waiting prompts part from the prefix), evicting as the engine does
        (never one a running request keeps); one already kept is used again instead. False when every slot is kept."""
        if key in self.checkpoints:
            self.checkpoint_order.touch(key)
            return True
        if len(self.checkpoints) >= self.model.checkpoint_slots:
            evicted = self.checkpoint_order.evict()
            if evicted is None:
                return False
            del self.checkpoints[evicted]
        self.checkpoints[key] = kind
        self.checkpoint_order.add(key, protected=shared)
        return True

    def _keep_prompt_end(self, live: _Live, key: int) -> None:
        """A re-rendered turn's next one resumes from its prompt end: it keeps that checkpoint while it runs, as
        the engine's requests with `resume_tail_tokens` do (`SegmentedLru.pin`)."""
        live.prompt_key = key
        if not live.pinned:
            live.pinned = self.checkpoint_order.pin(key)

    def _prompt_checkpoints(self, live: _Live, hit_blocks: int, branch_tokens: int, shared_tokens: int = 0) -> None:
        """The prompt's last block boundary, every interval inside it, where it leaves cached blocks and where a
        waiting prompt leaves it, each where the engine takes it while the prompt runs in one chunk from the resume
        point: there when the chunk ends on it, else at the last PREFILL_CHUNK_TOKENS multiple from the resume point
        at or before it (none where that is the resume point)."""
        prompt_tokens, tail = live.request.prompt_tokens, live.request.resume_tail_tokens
        prompt_end = (prompt_tokens - tail) // self.block * self.block
        start = hit_blocks * self.block
        interval = self.model.checkpoint_interval_tokens
        boundaries = {prompt_end: PROMPT_END}
        if interval:
            for boundary in range((start // interval + 1) * interval, prompt_end, interval):
                boundaries.setdefault(boundary, INSIDE_PROMPT)
        for boundary in (branch_tokens, shared_tokens):
            if start < boundary < prompt_end:
                boundaries.setdefault(boundary, INSIDE_PROMPT)
        taken = set()
        for boundary, kind in sorted(boundaries.items()):
            point = boundary if boundary == prompt_tokens else (
                start + (boundary - start) // PREFILL_CHUNK_TOKENS * PREFILL_CHUNK_TOKENS)
            if point > start and point not in taken:
                taken.add(point)
                key = live.keys[point // self.block - 1]
                if self._checkpoint(key, kind, shared=boundary == shared_tokens) and kind == PROMPT_END and tail:
                    self._keep_prompt_end(live, key)

    def _register(self, live: _Live, computed_tokens: int) -> None:
        """Make `live`'s computed full blocks cached entries (align mode: each keeps a state page, if one is free)."""
        full = min(computed_tokens // self.block, len(live.keys))
        if self.model.unbounded:
            self.seen.update(live.keys[:full])
            return
        for index in range(len(live.shared), full):
            key = live.keys[index]
            if key in self.refs:
                if key in self.lru:
                    del self.lru[key]
                self.refs[key] += 1
                self.free_units += self._private_units(1)
            elif not self._take(self.entry_units - self._private_units(1)):
                break
            else:
                self.refs[key] = 1
            live.shared.append(key)
            live.private_blocks -= 1

    def grow(self, live: _Live) -> bool:
        needed = -(-(live.context_tokens + 1) // self.block) - len(live.shared) - live.private_blocks
        if needed > 0 and not self._take(self._private_units(needed)):
            return False
        live.private_blocks += max(0, needed)
        return True

    def release(self, live: _Live, finished: bool) -> None:
        computed = live.context_tokens - 1 if finished else live.context_tokens
        self._register(live, computed)
        if live.pinned:
            self.checkpoint_order.unpin(live.prompt_key)
            live.pinned = False
        if finished and self._needs_checkpoint():
            boundary = computed // self.block * self.block
            if live.request.resume_tail_tokens:  # its next turn resumes from the prompt end: the freshest now
                if live.prompt_key in self.checkpoints:
                    self.checkpoint_order.refresh(live.prompt_key)
            elif boundary > live.request.prompt_tokens // self.block * self.block:
                self._checkpoint(live.keys[boundary // self.block - 1], OUTPUT_END)
        for key in reversed(live.shared):  # its last block first on the LRU: a prefix outlives its tail
            self.refs[key] -= 1
            if not self.refs[key]:
                self.lru[key] = None
        self.free_units += self._private_units(live.private_blocks) + self.pool.state_units_per_request
        live.shared, live.private_blocks, live.has_state = [], 0, False

    def cached_bytes(self) -> tuple[int, int]:
        if self.model.unbounded:
            return 0, 0
        entries = len(self.refs)
        block_bytes = entries * (self.entry_units - self.model.entry_state_units) * self.pool.unit_bytes
        state_bytes = entries * self.model.entry_state_units * self.pool.unit_bytes
        return block_bytes, state_bytes + len(self.checkpoints) * self.pool.bytes_per_request

    def check(self, running: list[_Live], waiting) -> None:
        held = sum(self._private_units(e.private_blocks) + self.pool.state_units_per_request for e in running)
        entries = len(self.refs) * self.entry_units
        if held + entries + self.free_units != self.pool.pool_units or self.free_units < 0:
            raise AssertionError(f"{self.pool.label}: {held} held + {entries} cached + {self.free_units} free "
                                 f"!= {self.pool.pool_units} units")
        counts = Counter(key for e in running for key in e.shared)
        if any(self.refs.get(key, 0) != count for key, count in counts.items()):
            raise AssertionError(f"{self.pool.label}: an entry's reference count differs from its holders")
        if set(self.lru) != {key for key, refs in self.refs.items() if refs == 0}:
            raise AssertionError(f"{self.pool.label}: the LRU list is not the unreferenced entries")
        if any(e.has_state or e.shared or e.private_blocks or e.pinned for e in waiting):
            raise AssertionError(f"{self.pool.label}: a waiting request still holds units")
        if len(self.checkpoints) > self.model.checkpoint_slots:
            raise AssertionError(f"{self.pool.label}: more checkpoints than slots")
        if sum(self.checkpoint_order.pins.values()) != sum(e.pinned for e in running):
            raise AssertionError(f"{self.pool.label}: kept checkpoints and the running requests keeping them differ")
        if set(self.checkpoint_order.keys) != set(self.checkpoints) or self.checkpoint_order.problems():
            raise AssertionError(f"{self.pool.label}: the checkpoints' eviction order is not theirs: "
                                 f"{self.checkpoint_order.problems()}")


def replay_prefix(model: PrefixCacheModel, requests: list[TokenRequest], max_model_len: int,
                  check_invariants: bool = False) -> PrefixReplayResult:
    """Run `requests` through `model`'s pool and prefix cache until every request finished or was refused."""
    state = _Replay(model, max_model_len)
    result, pool = state.result, model.pool
    pending = deque(sorted(requests, key=lambda r: r.arrival_step))
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    step = counter = 0
    while pending or waiting or running:
        while pending and pending[0].arrival_step <= step:
            request = pending.popleft()
            if request.total_tokens > max_model_len or pool.units_for_request(request.total_tokens) > pool.pool_units:
                result.refused += 1
                continue
            keys = block_keys(request.prompt_ids + request.output_ids, state.block, request.cache_salt)
            waiting.append(_Live(request, counter, keys))
            counter += 1
        running = decode_step(running, waiting, state.grow, lambda entry: state.release(entry, finished=False),
                              result)
        while waiting and len(running) < pool.max_running:
            entry = waiting[0]
            if not state.admit(entry, waiting):
                break
            waiting.popleft()
            entry.generated += 1  # the prefill step produces the first output token
            running.append(entry)
        for entry in [e for e in running if e.generated >= e.request.output_tokens]:
            state.release(entry, finished=True)
            result.completed += 1
        running = [e for e in running if e.generated < e.request.output_tokens]
        block_bytes, checkpoint_bytes = state.cached_bytes()
        result.peak_cached_block_bytes = max(result.peak_cached_block_bytes, block_bytes)
        result.peak_checkpoint_bytes = max(result.peak_checkpoint_bytes, checkpoint_bytes)
        if check_invariants:
            state.check(running, waiting)
            result.invariant_checks += 1
        step += 1
        if not running and not waiting and pending:
            step = max(step, pending[0].arrival_step)
    result.steps = step
    return result


def replay_prefix_all(models: dict[str, PrefixCacheModel], requests: list[TokenRequest], max_model_len: int,
                      check_invariants: bool = False) -> dict[str, PrefixReplayResult]:
    """Every allocator's replay; each gets the fraction of the ideal bound's hits it reaches."""
    results = {key: replay_prefix(model, requests, max_model_len, check_invariants) for key, model in models.items()}
    bound = next((r.hit_tokens for key, r in results.items() if models[key].unbounded), None)
    for result in results.values():
        if bound is not None:
            result.unbounded_fraction = result.hit_tokens / bound if bound else 1.0
    return results
