"""Continuous batching: who runs this step and how many tokens each gets.

Per step at most `max_num_batched_tokens` tokens run. Decodes go first (one token each), then running requests still in
prefill continue their chunk, then waiting requests are admitted first come, first served. While decodes run in a step,
its prefill chunks together take at most `max_prefill_tokens_with_decodes` tokens, which bounds the time of a decode
step under mixed load. A step that runs prefill beside decodes also costs more than its tokens: decode steps replay a
captured CUDA graph of the whole model, a mixed step replays only the token-wise pieces between the token mixers
(sidecar/execution/piecewise.py; eagerly above their largest bucket) and launches each mixer's sequence work, which
costs about as much host time whatever its prefill size. So while decodes run, waiting prompts are held back until the
prompt tokens ready (theirs and the rest of any prompt part way through its prefill) reach
`min_prefill_tokens_with_decodes`, or until they have been held `max_prefill_wait_steps` steps (fewer beside few
decodes: holding pays in proportion to the decoding requests, as both the prompts that arrive to share the mixed step
and the time each avoided mixed step saves grow with them, while the held prompt's wait does not); a held step runs
decodes only, or decodes and the prefills under way, and the new prompts then run together in fewer, fuller mixed
steps. A prompt part way through its prefill is never held.

With a TPOT target (`target_tpot_s`, `hybridkv serve --target-tpot-ms`), admission also waits on the time per step:
every decoding request gets one token a step, so its time per output token is the mean step time over its decoding.
While requests decode and the steps of the last `TPOT_WINDOW_S` seconds that ran decodes took longer than the target
on average, no waiting prompt is admitted: the running requests decode on in pure decode steps, the ones that finish
leave the batch, the steps shorten, and admission resumes. It trades the queued requests' time to first token for the
running ones' time per token, which more concurrent requests than the GPU can decode at the target would otherwise
share; at concurrency below that point it never holds. It never holds where the pure decode steps alone take the
target or longer (waiting prompts could not bring the steps under it), nor with no request decoding.

Admission needs a free state slot AND the token blocks for the whole next chunk, and stops at the first request that
does not fit (no overtaking). When a running request needs a block and none is free, the most recently admitted
request not yet scheduled this step is preempted by recompute: its slot and blocks are freed and it goes back to the
front of the waiting queue, to recompute its prompt and generated tokens from a zeroed state.

With the engine's step overlap, a request may hold tokens sampled on the device that the host has not read yet
(`Sequence.num_pending_tokens`). A running one still decodes (the model reads the pending id on the device); one that
already reaches max_tokens or max_model_len with them is not scheduled again; a preempted one is not readmitted until
its tokens are known, since its recompute needs their ids on the host.

With prefix caching on, a request being admitted first takes the longest cached prefix that has a state checkpoint
(its blocks are shared, the checkpoint is copied into its slot before the step) and prefills the rest; the chunk's
checkpoints (the prompt's last block boundary, every checkpoint interval, where it leaves cached blocks) are taken
while it runs (`CacheManager.plan_checkpoints`), so they never cost a step of their own, and a chunk the token
budget cuts short ends on a block boundary.

A burst of requests behind one new system prompt or document computes it once. A request being prefilled also
checkpoints where the longest prompt still waiting parts from its own (`Sequence.shared_tokens`), when that is at
least `SHARED_PREFIX_WAIT_TOKENS` beyond what it found cached; and a waiting request whose prompt shares a prefix at
least that much longer than its own cache hit with one still prefilling, up to a boundary that one will checkpoint,
waits for it: the blocks and the checkpoint become visible as the other's chunk launches, so a step or so later it
resumes there instead of computing the same tokens beside it. Requests behind it are admitted meanwhile; it keeps its
place in the queue, and waits no longer than the other takes to reach that boundary (a preempted or finished one no
longer counts).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from itertools import islice

from hybridkv.sidecar.core.cache import CacheManager
from hybridkv.sidecar.core.sequence import ScheduledChunk, Sequence, SequenceStatus
from hybridkv.sizing.prefix import SHARED_PREFIX_WAIT_TOKENS

# Waiting prompts are held at most one step per this many decoding requests, and at most max_prefill_wait_steps.
DECODES_PER_HELD_STEP = 2
# SHARED_PREFIX_WAIT_TOKENS (512, shared with the replay of `hybridkv simulate`): a waiting request waits for a prefix
# another one is computing when that saves it at least this many prompt tokens (about 8 ms of prefill for Qwen3.5-4B
# on one H100, against a step's wait).
# Waiting requests (from the front of the queue) compared with each prompt being prefilled for a prefix they share,
# and how many not compared before a step hashes for it (a burst of new requests is hashed over a few steps, not in
# one: about 60 µs each for a 512-token comparison on a 2-core CPU).
SHARED_PREFIX_SCAN = 128
SHARED_PREFIX_HASHES_PER_STEP = 16
# The window the time per step is read over against a TPOT target: about the decoding life of a reply of a hundred or
# two tokens at a 10-20 ms target, the time its TPOT is the mean over. A much shorter window lets each long mixed step
# (a hundred milliseconds for thousands of prompt tokens) shut admission on its own and the pure decode steps after
# it open it again, so the mean is steered a few steps at a time and overshoots.
TPOT_WINDOW_S = 2.0
# Steps the window must hold before it is read (fewer say little about the time per step).
TPOT_MIN_STEPS = 4


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 max_prefill_tokens_with_decodes: int | None = None, min_prefill_tokens_with_decodes: int = 0,
                 max_prefill_wait_steps: int = 0, target_tpot_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes or max_num_batched_tokens
        self.min_prefill_tokens_with_decodes = min_prefill_tokens_with_decodes  # 0: prefill is never held
        self.max_prefill_wait_steps = max_prefill_wait_steps
        self.held_steps = 0  # consecutive steps that held ready prefill back
        self.held_steps_total = 0
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the front has the highest priority
        self.preemptions_total = 0
        # Prefix cache: tokens looked up at admission, tokens found, and found tokens per checkpoint kind.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_hit_tokens_by_kind: Counter[str] = Counter()
        self.shared_prefix_waits_total = 0  # steps a waiting request waited for a prefix another was computing
        self._hashes_left = SHARED_PREFIX_HASHES_PER_STEP  # waiting prompts this step may hash to compare them
        self.target_tpot_s = target_tpot_s  # 0: admission never waits on the time per step
        self.clock = clock
        # Steps that ran decodes, within the last TPOT_WINDOW_S: (start, seconds to the next step, only decodes), and
        # the seconds of all of them and of the pure decode ones among them, with how many those are.
        self._decode_steps: deque[tuple[float, float, bool]] = deque()
        self._window_s = self._window_pure_s = 0.0
        self._window_pure_steps = 0
        self._last_step: tuple[float, bool] | None = None  # the previous step's start, and whether it only decoded
        self.tpot_held_steps_total = 0  # steps that admitted no waiting prompt to keep the TPOT target

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def schedule(self) -> list[ScheduledChunk]:
        """Pick this step's chunks, decodes first; allocates their blocks and slots."""
        budget = self.max_num_batched_tokens
        self._hashes_left = SHARED_PREFIX_HASHES_PER_STEP
        scheduled: dict[int, ScheduledChunk] = {}
        decodes = 0
        now = 0.0
        if self.target_tpot_s:
            now = self.clock()
            self._time_last_step(now)
        hold = self._hold_prefill()
        # Decodes, then unfinished prefills; both in admission order.
        decoding, prefilling = [], []
        for seq in self.running:
            (decoding if seq.num_uncomputed_tokens == 1 else prefilling).append(seq)
        for seq in decoding:
            if budget and self._schedule_decode(seq, scheduled):
                decodes += 1
                budget -= 1
        for seq in prefilling:
            if seq.status is not SequenceStatus.RUNNING or budget == 0 or seq.at_length_limit(self.max_model_len):
                continue
            if decodes:
                budget = min(budget, self._prefill_budget(scheduled))
                if budget == 0:
                    continue
            num_tokens = self._chunk_tokens(seq, seq.num_computed_tokens, budget)
            num_tokens = self._make_room(seq, num_tokens, scheduled)
            if num_tokens == 0:
                continue
            if self.cache.prefix_caching and num_tokens > 1:
                self._note_shared_prefix(seq, seq.num_computed_tokens)
            save, captures = self.cache.plan_checkpoints(seq, num_tokens)
            self.cache.grow(seq, num_tokens)
            scheduled[id(seq)] = ScheduledChunk(seq, num_tokens, save=save, captures=captures)
            budget -= num_tokens
        if decodes:
            budget = min(budget, self._prefill_budget(scheduled))
            if (not hold and self.target_tpot_s and self.waiting and len(self.running) < self.max_num_seqs
                    and self._over_tpot_target()):
                hold = True
                self.tpot_held_steps_total += 1
        position = 0  # in the waiting queue: those before it wait for a shared prefix
        while not hold and position < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[position]
            if seq.num_pending_tokens:
                break
            hit = self.cache.find_prefix(seq)
            start = hit.num_tokens(self.cache.block_size) if hit else 0
            if self.cache.prefix_caching and self._waits_for_shared_prefix(seq, start):
                self.shared_prefix_waits_total += 1
                position += 1
                continue
            num_tokens = self._chunk_tokens(seq, start, budget)
            if not self.cache.can_admit(seq, num_tokens, hit):
                break
            del self.waiting[position]
            self.cache.assign_slot(seq)
            restore = self.cache.resume(seq, hit) if hit else None  # hit.checkpoint None: the slot starts at zero
            if self.cache.prefix_caching:
                self._count_lookup(seq, hit)
                self._note_shared_prefix(seq, start)
            save, captures = self.cache.plan_checkpoints(seq, num_tokens)
            self.cache.grow(seq, num_tokens)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_s is None:  # its first admission: what its first token's wait came from
                seq.scheduled_s = time.monotonic()
                seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            scheduled[id(seq)] = ScheduledChunk(seq, num_tokens, fresh_slot=restore is None, restore=restore, save=save,
                                                captures=captures)
            budget -= num_tokens
        chunks = list(scheduled.values())
        # The batch layout puts 1-token steps first (the model runs them on the decode path).
        chunks.sort(key=lambda chunk: chunk.num_tokens != 1)
        if self.target_tpot_s:
            self._last_step = (now, all(chunk.num_tokens == 1 for chunk in chunks)) if decodes else None
        return chunks

    def _schedule_decode(self, seq: Sequence, scheduled: dict[int, ScheduledChunk]) -> bool:
        """Schedule one token of a decoding request, if it runs this step. Most decode steps need no new block and,
        without prefix caching, plan no checkpoint: those take no pool arithmetic."""
        if seq.status is not SequenceStatus.RUNNING or seq.at_length_limit(self.max_model_len):
            return False
        cache = self.cache
        if seq.num_computed_tokens >= len(seq.block_table) * cache.block_size:  # its last block is full
            if not self._make_room(seq, 1, scheduled):
                return False
            cache.grow(seq, 1)
        save, captures = cache.plan_checkpoints(seq, 1) if cache.prefix_caching else (None, ())
        scheduled[id(seq)] = ScheduledChunk(seq, 1, save=save, captures=captures)
        return True

    def _time_last_step(self, now: float) -> None:
        """Count the step before this one in the TPOT window if it ran decodes (its time: from its start to this
        step's), and drop the steps that began before the window. A step after which nothing was running is left
        out: the engine may have waited idle before this one."""
        if self._last_step is not None and self.running:
            start, only_decodes = self._last_step
            self._count_step(now - start, only_decodes, 1)
            self._decode_steps.append((start, now - start, only_decodes))
        self._last_step = None
        while self._decode_steps and self._decode_steps[0][0] < now - TPOT_WINDOW_S:
            _, seconds, only_decodes = self._decode_steps.popleft()
            self._count_step(seconds, only_decodes, -1)
        if not self._decode_steps:  # no rounding left behind by the sums
            self._window_s = self._window_pure_s = 0.0

    def _count_step(self, seconds: float, only_decodes: bool, sign: int) -> None:
        self._window_s += sign * seconds
        if only_decodes:
            self._window_pure_s += sign * seconds
            self._window_pure_steps += sign

    def _over_tpot_target(self) -> bool:
        """Whether the window's decoding steps took longer than the TPOT target on average, while its pure decode
        steps did not (if they did too, holding prompts back would not bring the steps under it)."""
        steps = len(self._decode_steps)
        if steps < TPOT_MIN_STEPS or self._window_s <= self.target_tpot_s * steps:
            return False
        pure = self._window_pure_steps
        return pure < TPOT_MIN_STEPS or self._window_pure_s < self.target_tpot_s * pure

    def _hold_prefill(self) -> bool:
        """Whether this step admits no waiting prompt: decodes run, the prompt tokens ready (the waiting prompts' and
        the rest of any prompt part way through its prefill, which runs regardless) are fewer than
        `min_prefill_tokens_with_decodes`, and the waiting prompts have been held fewer steps than their bound:
        `max_prefill_wait_steps`, or one step per two decoding requests where that is less. Counts the held steps."""
        if (not self.min_prefill_tokens_with_decodes or not self.waiting
                or len(self.running) >= self.max_num_seqs):  # nothing could be admitted anyway
            self.held_steps = 0
            return False
        running = [seq for seq in self.running
                   if seq.status is SequenceStatus.RUNNING and not seq.at_length_limit(self.max_model_len)]
        decoding = sum(1 for seq in running if seq.num_uncomputed_tokens == 1)
        if self.held_steps >= min(self.max_prefill_wait_steps, -(-decoding // DECODES_PER_HELD_STEP)):
            self.held_steps = 0
            return False
        ready = 0
        for seq in (*(seq for seq in running if seq.num_uncomputed_tokens > 1), *self.waiting):
            ready += seq.num_uncomputed_tokens
            if ready >= self.min_prefill_tokens_with_decodes:
                self.held_steps = 0
                return False
        self.held_steps += 1
        self.held_steps_total += 1
        return True

    def _note_shared_prefix(self, seq: Sequence, computed: int) -> None:
        """Set `seq.shared_tokens` to the longest prefix of its prompt a waiting prompt shares, if that reaches
        SHARED_PREFIX_WAIT_TOKENS beyond its `computed` tokens (a waiting request sharing it found no more cached: it
        would have found the same blocks and checkpoints), else 0. Each waiting prompt must keep a token to run."""
        block_size, wanted = self.cache.block_size, computed + SHARED_PREFIX_WAIT_TOKENS
        # Only a prompt with the same hash at the block ending `wanted` tokens in can share that much (hashes chain):
        # one comparison per waiting prompt, which is hashed no further than that block until it shares it.
        anchor = -(-wanted // block_size) - 1
        ours = self.cache.block_hashes_upto(seq, anchor + 1)
        best = 0
        for other in islice(self.waiting, SHARED_PREFIX_SCAN) if anchor < len(ours) else ():
            theirs = other.block_hashes
            if len(theirs) <= anchor:  # hashed up to that block once (a few a step), then read
                if len(other.token_ids) // block_size <= anchor:
                    continue  # too short to share that much
                if not self._hashes_left:
                    continue
                self._hashes_left -= 1
                theirs = self.cache.block_hashes_upto(other, anchor + 1)
            if other is not seq and theirs[anchor] == ours[anchor]:
                shared = self.cache.shared_prefix_tokens(seq, other)
                best = max(best, min(shared, (other.num_tokens - 1) // block_size * block_size))
        seq.shared_tokens = best if best >= wanted else 0

    def _waits_for_shared_prefix(self, seq: Sequence, cached_tokens: int) -> bool:
        """Whether a request still prefilling will checkpoint a prefix of `seq` at least SHARED_PREFIX_WAIT_TOKENS
        longer than the `cached_tokens` it would resume from now."""
        prefilling = (other for other in self.running
                      if other.status is SequenceStatus.RUNNING and other.num_computed_tokens < other.num_prompt_tokens)
        return self.cache.prefix_in_flight(seq, prefilling) >= cached_tokens + SHARED_PREFIX_WAIT_TOKENS

    def _prefill_budget(self, scheduled: dict[int, ScheduledChunk]) -> int:
        """Prefill tokens still allowed in a step that runs decodes."""
        prefill_tokens = sum(chunk.num_tokens for chunk in scheduled.values() if chunk.num_tokens > 1)
        return max(0, self.max_prefill_tokens_with_decodes - prefill_tokens)

    def _chunk_tokens(self, seq: Sequence, computed: int, budget: int) -> int:
        """Tokens of `seq` to run from `computed` within `budget` (with prefix caching, a chunk cut short by the
        budget ends on a block boundary)."""
        return self.cache.chunk_end(seq, computed, min(seq.num_tokens - computed, budget))

    def _count_lookup(self, seq: Sequence, hit) -> None:
        self.prefix_queried_tokens += seq.num_tokens
        if hit is not None and hit.checkpoint is not None:
            tokens = hit.num_tokens(self.cache.block_size)
            self.prefix_hit_tokens += tokens
            self.prefix_hit_tokens_by_kind[hit.checkpoint.kind.value] += tokens

    def launched(self, chunks: list[ScheduledChunk]) -> None:
        """The chunks run on the device: their tokens count as computed, and their full blocks and checkpoints with
        known tokens become visible to later requests."""
        for chunk in chunks:
            if chunk.seq.finished:  # stopped by the previous step's token, read while this one launched
                continue
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.cache.commit(chunk.seq)

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: dict[int, ScheduledChunk]) -> int:
        """Tokens `seq` can run now: preempt lower-priority requests for blocks, shrink a prefill chunk if that
        suffices, or preempt `seq` itself (returning 0) when nothing else can give way."""
        while not self.cache.can_grow(seq, num_tokens):
            victim = next((other for other in reversed(self.running)
                           if other is not seq and id(other) not in scheduled), None)
            if victim is None:
                fitting = min(num_tokens, self.cache.tokens_that_fit(seq))
                if fitting > 0:
                    return fitting
                self._preempt(seq)
                return 0
            self._preempt(victim)
        return num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], stopped: list[bool]) -> list[str | None]:
        """The one place a step's result changes its sequences: append each sampled token the host has now read,
        then finish the request on a stop (`stopped`: its id or its text ended it) or at its length limit, freeing
        its slot and blocks at once. Returns each sequence's finish reason, None while it runs on."""
        reasons = []
        for seq, token_id, stop in zip(seqs, token_ids, stopped):
            seq.num_pending_tokens -= 1
            seq.token_ids.append(token_id)
            self.cache.commit(seq)
            reason = "stop" if stop else "length" if seq.at_length_limit(self.max_model_len,
                                                                         count_pending=False) else None
            if reason is not None:
                self.finish(seq, reason)
            reasons.append(reason)
        return reasons

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a request (stop, length) and free its slot and blocks at once. It is running, or waiting when it
        was preempted after its last token was sampled."""
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self._retire(seq, reason)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._retire(seq, "abort")
                    return seq
        return None

    def _retire(self, seq: Sequence, reason: str) -> None:
        self.cache.release(seq, finished=reason != "abort")
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_pending_tokens = 0  # a later step's token for it, if any, is dropped
