"""Prefix caching: greedy tokens identical with it on and off, hits where they should be, pools that never leak.

Workloads are seeded: multi-turn chats (each turn's prompt is the previous prompt, the model's reply and a new user
message) and shared-document prompts (one long prefix, different questions). Settings cover chunked prefill (steps
shorter than a prompt), preemption and eviction (pools too small for the workload) and tensor parallelism (tp=2 over
gloo). A hypothesis state machine drives add / step / abort / preempt / evict against a small engine.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from engine_fixtures import make_engine, pool_budget, tiny_checkpoint  # noqa: F401 - pytest fixture
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.sidecar.core import scheduler as scheduler_module
from hybridkv.sidecar.core.outputs import Completion
from hybridkv.sidecar.core.sampling import RequestError, SamplingParams

BLOCK_SIZE = 16
VOCAB = 500
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def checkpoint_budget(folder: str, state_slots: int, token_blocks: int, checkpoint_slots: int) -> int:
    """The budget holding exactly these pools: a checkpoint costs one request's state."""
    bytes_per_request = pool_budget(folder, 1, 0, BLOCK_SIZE) - pool_budget(folder, 0, 0, BLOCK_SIZE)
    return pool_budget(folder, state_slots, token_blocks, BLOCK_SIZE) + checkpoint_slots * bytes_per_request


def engine_with(folder: str, caching: bool, state_slots: int, token_blocks: int, checkpoint_slots: int,
                **overrides):
    prefix = dict(enable_prefix_caching=True, prefix_checkpoint_slots=checkpoint_slots) if caching else {}
    budget = checkpoint_budget(folder, state_slots, token_blocks, checkpoint_slots if caching else 0)
    return make_engine(folder, max_num_seqs=state_slots, block_size=BLOCK_SIZE, kv_cache_memory_bytes=budget,
                       max_model_len=min(token_blocks * BLOCK_SIZE, 400), **prefix, **overrides)


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def multi_turn(engine, seed: int, conversations: int = 3, turns: int = 3) -> list[list[int]]:
    """Every conversation's replies, turn by turn; all conversations of a turn run at once."""
    rng = random.Random(seed)
    system = tokens(rng, 37)
    histories = [system + tokens(rng, rng.randrange(5, 25)) for _ in range(conversations)]
    replies = []
    for _ in range(turns):
        completions = engine.generate(histories, GREEDY)
        replies += [completion.token_ids for completion in completions]
        histories = [history + completion.token_ids + tokens(rng, rng.randrange(3, 12))
                     for history, completion in zip(histories, completions)]
        engine.check_invariants()
    return replies


TAIL = 3  # a rendered prompt's last tokens a re-rendering client does not send again (Qwen's `<think>` and more)


def rerendered_chat(engine, seed: int, conversations: int = 3, turns: int = 3) -> list[list[int]]:
    """Multi-turn chats whose client re-renders the history, as the chat endpoint's clients do: every prompt ends
    with TAIL tokens the next turn replaces by the reply written differently (other ids), then a new user message."""
    rng = random.Random(seed)
    system = tokens(rng, 37)
    histories = [system + tokens(rng, rng.randrange(5, 25)) for _ in range(conversations)]
    tail = tokens(rng, TAIL)
    params = replace(GREEDY, resume_tail_tokens=TAIL)
    replies = []
    for _ in range(turns):
        completions = engine.generate([history + tail for history in histories], params)
        replies += [completion.token_ids for completion in completions]
        histories = [history + [(token + 1) % VOCAB for token in completion.token_ids] + tokens(rng, rng.randrange(3, 12))
                     for history, completion in zip(histories, completions)]
        engine.check_invariants()
    return replies


def shared_document(engine, seed: int, questions: int = 5) -> list[list[int]]:
    """Questions about one document: two alone (the second resumes inside the document, from the checkpoint the
    first took while its prompt ran), then the rest together."""
    rng = random.Random(seed)
    document = tokens(rng, 75)
    prompts = [document + tokens(rng, rng.randrange(2, 20)) for _ in range(questions)]
    completions = engine.generate(prompts[:1], GREEDY) + engine.generate(prompts[1:2], GREEDY)
    completions += engine.generate(prompts[2:], GREEDY)
    engine.check_invariants()
    return [completion.token_ids for completion in completions]


# Greedy tokens with caching on and off agree only where the argmax is decisive: a resumed or chunked prefill sums in
# another order, which moves float32 logits by ~4e-5, so a workload whose top two logits come closer is not a test.
DECISIVE_LOGIT_GAP = 1e-3


class GreedyMargins:
    """An engine whose `generate` also records, for every greedy token, how far its logit leads the runner-up."""

    def __init__(self, engine):
        self.engine = engine
        self.gaps: list[float] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        completions = self.engine.generate(prompts, replace(params, logprobs=2))
        self.gaps += [token.top[0][1] - token.top[1][1] for completion in completions for token in completion.logprobs]
        return completions

    def check_invariants(self) -> None:
        self.engine.check_invariants()


def assert_drained(engine) -> None:
    """Nothing held once every request is done: blocks are free or cached, checkpoints free or keyed."""
    engine.check_invariants()
    stats = engine.stats()
    assert (stats.used_token_blocks, stats.used_state_slots, engine.cache.checkpoints.num_pending) == (0, 0, 0)


ROOMY = dict(state_slots=4, token_blocks=80, checkpoint_slots=12)
# Steps of 24 tokens (chunked prefill), 9 blocks for 3-4 requests of ~100 tokens (preemption, LRU eviction of cached
# blocks) and 2 checkpoints for a workload that takes many (LRU eviction of checkpoints).
TIGHT = dict(state_slots=4, token_blocks=9, checkpoint_slots=2, max_num_batched_tokens=24)


@pytest.fixture(params=["default", "tiny"], ids=["wait-default", "wait-16"])
def shared_prefix_wait(request, monkeypatch):
    """Run with the scheduler's wait for a shared prefix at its default (longer than these tiny prompts share) and
    at 16 tokens, where requests admitted together wait for each other's prefixes."""
    if request.param == "tiny":
        monkeypatch.setattr(scheduler_module, "SHARED_PREFIX_WAIT_TOKENS", 16)
    return request.param


@pytest.mark.parametrize("workload", [multi_turn, rerendered_chat, shared_document])
@pytest.mark.parametrize("pools", [ROOMY, TIGHT], ids=["roomy", "tight"])
@pytest.mark.parametrize("seed", [1, 2])  # seed 0's chats meet logits tied to one float32 ulp on the tiny model
def test_greedy_tokens_are_the_same_with_prefix_caching_on_and_off(tiny_checkpoint, workload, pools, seed,
                                                                   shared_prefix_wait):
    off = GreedyMargins(engine_with(tiny_checkpoint, False, **pools))
    on = engine_with(tiny_checkpoint, True, **pools)
    expected = workload(off, seed)
    assert min(off.gaps) > DECISIVE_LOGIT_GAP, "the workload meets a near-tie: the comparison would test rounding"
    assert workload(on, seed) == expected
    assert_drained(on)
    stats = on.stats()
    assert 0 < stats.prefix_cache_hits_total < stats.prefix_cache_queries_total
    assert off.engine.stats().prefix_cache_queries_total == 0
    if pools is TIGHT:
        assert stats.preemptions_total > 0


def test_hits_are_counted_per_checkpoint_kind(tiny_checkpoint):
    """Multi-turn chats resume from the previous reply's end; shared documents from the first prompt's checkpoint
    for its end, at the last 64-token chunk start before it (64 of a ~80-token prompt); so does a longer prompt."""
    engine = engine_with(tiny_checkpoint, True, **ROOMY)
    multi_turn(engine, seed=3)
    assert engine.stats().prefix_cache_hits_by_kind.get("output_end", 0) > 0
    engine = engine_with(tiny_checkpoint, True, **ROOMY)
    shared_document(engine, seed=3)
    assert set(engine.stats().prefix_cache_hits_by_kind) == {"prompt_end"}
    engine = engine_with(tiny_checkpoint, True, **ROOMY)
    rng = random.Random(4)
    prompt = tokens(rng, 140)
    engine.generate([prompt], GREEDY)
    engine.generate([prompt + tokens(rng, 9)], GREEDY)
    assert engine.stats().prefix_cache_hits_by_kind == {"prompt_end": 128}


def test_a_re_rendered_turn_resumes_before_the_previous_prompts_tail(tiny_checkpoint):
    """A 96-token prompt whose last TAIL tokens the next turn sends differently is checkpointed at the last block
    boundary before them, 80 (its own last one, 96, is past where the next turn parts from it; steps of 16 tokens
    end on every boundary), and takes no output-end checkpoint; the next turn resumes at 80."""
    rng = random.Random(5)
    body, tail = tokens(rng, 96 - TAIL), tokens(rng, TAIL)
    engine = engine_with(tiny_checkpoint, True, **ROOMY, max_num_batched_tokens=16)
    params = replace(GREEDY, resume_tail_tokens=TAIL)
    (first,) = engine.generate([body + tail], params)
    kinds = {checkpoint.kind.value for checkpoint in engine.cache.checkpoints._keyed.values()}
    assert "output_end" not in kinds
    (second,) = engine.generate([body + [token + 1 for token in first.token_ids] + tokens(rng, 5)], params)
    assert second.cached_tokens == 80
    assert engine.stats().prefix_cache_hits_by_kind == {"prompt_end": 80}
    assert_drained(engine)


def test_a_running_re_rendered_request_keeps_its_prompt_end_checkpoint(tiny_checkpoint):
    """Checkpoints taken while a request decodes (other prompts' ends) evict the oldest first: the prompt end of a
    request whose next turn re-renders it is kept while it runs (at most half the slots are kept), so its next turn
    still finds it; without the tail it is evicted."""

    def next_turn_cached(tail: int) -> tuple[int, int]:
        rng = random.Random(6)
        engine = engine_with(tiny_checkpoint, True, state_slots=4, token_blocks=80, checkpoint_slots=2)
        prompt = tokens(rng, 70)  # its prompt end at 64 with or without the tail
        engine.add_request("turn-1", prompt, replace(GREEDY, max_tokens=40, resume_tail_tokens=tail))
        for index in range(6):  # one after the other beside it, each checkpointing its own prompt at 64
            engine.add_request(f"other-{index}", tokens(rng, 90), replace(GREEDY, max_tokens=1))
            while not any(output.request_id == f"other-{index}" and output.finished for output in engine.step()):
                pass
        kept = engine.cache.checkpoints.pinned
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_invariants()
        assert not engine.cache.checkpoints.pinned
        (second,) = engine.generate([prompt[:-max(tail, 1)] + tokens(rng, 9)], GREEDY)
        return second.cached_tokens, len(kept)

    assert next_turn_cached(TAIL) == (64, 1)
    assert next_turn_cached(0) == (0, 0)


def test_each_request_reports_the_prompt_tokens_it_took_from_the_cache(tiny_checkpoint):
    """The prompt-end checkpoint of a 140-token prompt sits at 128: a longer prompt on it reports those 128 tokens as
    cached, as its own usage (the counters say the same), and a request of an engine without caching reports 0."""
    rng = random.Random(4)
    prompt = tokens(rng, 140)
    longer = prompt + tokens(rng, 9)
    engine = engine_with(tiny_checkpoint, True, **ROOMY)
    (first,) = engine.generate([prompt], GREEDY)
    (second,) = engine.generate([longer], GREEDY)
    assert (first.cached_tokens, second.cached_tokens) == (0, 128)
    assert engine.stats().prefix_cache_hits_total == 128
    uncached = engine_with(tiny_checkpoint, False, **ROOMY)
    uncached.generate([prompt], GREEDY)
    assert [c.cached_tokens for c in uncached.generate([longer], GREEDY)] == [0]


def prefill_steps(engine) -> int:
    return engine.stats().steps_by_kind_total["prefill"]


def test_a_shared_prefix_is_checkpointed_where_prompts_part_without_a_step_of_its_own(tiny_checkpoint):
    """Two prompts share 130 tokens, cached in 16-token blocks up to 128: the second, finding the blocks but no
    checkpoint, checkpoints where it leaves them (128) while its prompt runs, so a third resumes there; every prompt
    runs in one prefill step, checkpoints included."""
    engine = engine_with(tiny_checkpoint, True, **ROOMY)
    rng = random.Random(9)
    system = tokens(rng, 130)
    for expected_steps, question in enumerate((tokens(rng, 70), tokens(rng, 70), tokens(rng, 70)), start=1):
        engine.generate([system + question], GREEDY)
        assert prefill_steps(engine) == expected_steps
    assert engine.stats().prefix_cache_hits_by_kind == {"inside_prompt": 128}
    assert_drained(engine)


def test_a_burst_behind_one_new_prefix_computes_it_once(tiny_checkpoint, monkeypatch):
    """Four questions behind one new 130-token prefix, all at once. By default (a wait pays from 512 tokens) they
    are admitted together and each computes the prefix. With the wait at 64 tokens the first checkpoints where the
    others part from it (128) and they wait for it, then resume there: the same tokens, 3 x 128 of them cached."""
    rng = random.Random(11)
    system = tokens(rng, 130)
    prompts = [system + tokens(rng, 60) for _ in range(4)]
    one_step = dict(ROOMY, max_num_batched_tokens=1024)  # all four prompts fit one step
    expected = engine_with(tiny_checkpoint, False, **one_step).generate(prompts, GREEDY)
    together = engine_with(tiny_checkpoint, True, **one_step)
    assert [c.token_ids for c in together.generate(prompts, GREEDY)] == [c.token_ids for c in expected]
    assert (together.stats().prefix_cache_hits_total, together.scheduler.shared_prefix_waits_total) == (0, 0)

    monkeypatch.setattr(scheduler_module, "SHARED_PREFIX_WAIT_TOKENS", 64)
    engine = engine_with(tiny_checkpoint, True, **one_step)
    completions = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in completions] == [c.token_ids for c in expected]
    assert [c.cached_tokens for c in completions] == [0, 128, 128, 128]
    assert engine.stats().prefix_cache_hits_by_kind == {"inside_prompt": 3 * 128}
    assert engine.scheduler.shared_prefix_waits_total == 3  # each waited one step
    assert_drained(engine)


def test_a_request_waits_only_for_a_prefix_worth_a_step(tiny_checkpoint, monkeypatch):
    """Sharing less than the wait's worth, or only with a request whose prefill is done, a request does not wait."""
    monkeypatch.setattr(scheduler_module, "SHARED_PREFIX_WAIT_TOKENS", 160)
    rng = random.Random(12)
    system = tokens(rng, 130)
    engine = engine_with(tiny_checkpoint, True, **ROOMY, max_num_batched_tokens=1024)
    engine.generate([system + tokens(rng, 60) for _ in range(3)], GREEDY)
    assert engine.scheduler.shared_prefix_waits_total == 0 and engine.stats().prefix_cache_hits_total == 0
    # A decoding request's prompt is computed: one sharing it later finds blocks, not a prefill to wait for.
    engine.add_request("first", system + tokens(rng, 60), GREEDY)
    engine.step()
    engine.add_request("second", system + tokens(rng, 60), GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.shared_prefix_waits_total == 0
    assert_drained(engine)


def test_a_burst_is_compared_a_few_waiting_prompts_a_step(tiny_checkpoint, monkeypatch):
    """Waiting prompts are compared with those being prefilled by one block hash each; a step hashes at most
    SHARED_PREFIX_HASHES_PER_STEP prompts not compared before, so a large burst is not hashed in one step."""
    monkeypatch.setattr(scheduler_module, "SHARED_PREFIX_WAIT_TOKENS", 32)
    monkeypatch.setattr(scheduler_module, "SHARED_PREFIX_HASHES_PER_STEP", 5)
    engine = engine_with(tiny_checkpoint, True, **ROOMY, max_num_batched_tokens=1024)
    rng = random.Random(13)
    for index in range(20):
        engine.add_request(f"r{index}", tokens(rng, 100), GREEDY)
    engine.step()
    waiting = engine.scheduler.waiting
    assert len(waiting) == 16  # four state slots
    # The first admitted prompt compares the queue's front and hashes five of it, by their first two blocks only;
    # three of those are admitted next (looked up, so hashed whole) and two still wait, the rest unhashed.
    assert [len(seq.block_hashes) for seq in waiting] == [2, 2] + [0] * 14
    while engine.has_unfinished_requests():
        engine.step()
    assert_drained(engine)


def test_a_waiting_prompt_too_short_to_share_costs_no_hash(tiny_checkpoint, monkeypatch):
    """With one new hash a step, a short prompt at the queue's front does not use it up: the one behind it, which
    shares the first prompt's prefix, is still compared, waits a step and resumes at its checkpoint (64)."""
    monkeypatch.setattr(scheduler_module, "SHARED_PREFIX_WAIT_TOKENS", 32)
    monkeypatch.setattr(scheduler_module, "SHARED_PREFIX_HASHES_PER_STEP", 1)
    rng = random.Random(14)
    prefix = tokens(rng, 100)
    engine = engine_with(tiny_checkpoint, True, **ROOMY, max_num_batched_tokens=1024)
    completions = engine.generate([prefix + tokens(rng, 8), tokens(rng, 20), prefix + tokens(rng, 8)], GREEDY)
    assert [c.cached_tokens for c in completions] == [0, 0, 64]
    assert engine.scheduler.shared_prefix_waits_total == 1
    assert_drained(engine)


def test_a_long_prompt_is_checkpointed_every_interval(tiny_checkpoint):
    engine = engine_with(tiny_checkpoint, True, **ROOMY, prefix_checkpoint_interval=32)
    rng = random.Random(5)
    prompt = tokens(rng, 110)
    engine.generate([prompt], GREEDY)
    assert prefill_steps(engine) == 1  # 32 is the chunk's first 64-token chunk: no checkpoint there, none cut short
    # A prompt sharing only the first 70 tokens resumes from the interval checkpoint at 64.
    engine.generate([prompt[:70] + tokens(rng, 5)], GREEDY)
    assert engine.stats().prefix_cache_hits_by_kind == {"inside_prompt": 64}


def test_cache_salt_keeps_tenants_apart(tiny_checkpoint):
    engine = engine_with(tiny_checkpoint, True, **ROOMY)
    prompt = tokens(random.Random(6), 100)
    salted = [SamplingParams(temperature=0.0, max_tokens=4, cache_salt=salt) for salt in ("tenant-a", "tenant-b")]
    first = engine.generate([prompt], [salted[0]])
    other_tenant = engine.generate([prompt], [salted[1]])
    assert engine.stats().prefix_cache_hits_total == 0
    same_tenant = engine.generate([prompt], [salted[0]])
    assert engine.stats().prefix_cache_hits_total == 64
    assert first[0].token_ids == other_tenant[0].token_ids == same_tenant[0].token_ids
    with pytest.raises(RequestError, match="cache_salt"):
        engine.add_request("bad", prompt, SamplingParams(cache_salt=""))
    for tail in (-1, 100, 1.5, True):  # the tail is part of the prompt and leaves a token before it
        with pytest.raises(RequestError, match="resume_tail_tokens"):
            engine.add_request("bad", prompt, SamplingParams(resume_tail_tokens=tail))
    engine.check_invariants()


def test_checkpoint_pool_is_its_own_line_in_capacity(tiny_checkpoint):
    off = engine_with(tiny_checkpoint, False, **ROOMY).capacity().to_dict()
    on = engine_with(tiny_checkpoint, True, **ROOMY).capacity().to_dict()
    bytes_per_request = on["state_pool_bytes"] // (on["state_slots"] + 1)
    assert on["checkpoint_slots"] == 12 and on["checkpoint_pool_bytes"] == 12 * bytes_per_request
    assert off["checkpoint_slots"] == 0 and off["checkpoint_pool_bytes"] == 0
    assert on["token_blocks"] == off["token_blocks"]  # each budget was sized to hold both
    assert on["predicted"]["checkpoint_slots"] == 12
    assert on["checkpoint_attention_tokens"] == on["checkpoint_pool_bytes"] // (
        on["token_pool_bytes"] // ((on["token_blocks"] + 1) * BLOCK_SIZE))


def test_default_checkpoint_slots_are_half_the_state_slots(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, max_num_seqs=7, enable_prefix_caching=True)
    assert engine.capacity().checkpoint_slots == 4  # rounded up


def test_tensor_parallel_ranks_restore_the_same_checkpoints(tiny_checkpoint):
    """tp=2 with caching on gives the single-rank engine's tokens with caching off; every rank copies alike."""
    off = engine_with(tiny_checkpoint, False, **ROOMY)
    expected = multi_turn(off, seed=7, conversations=2, turns=2)
    tp = make_engine(tiny_checkpoint, tensor_parallel_size=2, max_num_seqs=4, block_size=BLOCK_SIZE,
                     enable_prefix_caching=True, prefix_checkpoint_slots=12, max_num_batched_tokens=24,
                     max_model_len=400)
    try:
        assert multi_turn(tp, seed=7, conversations=2, turns=2) == expected
        assert tp.stats().prefix_cache_hits_total > 0
        assert_drained(tp)
    finally:
        tp.close()


def long_shared_prefix(engine, seed: int) -> list[list[int]]:
    """Questions behind a 130-token shared prefix, one at a time and then together: the second checkpoints where
    the prompts part (128) and for its prompt's end (192) inside its one prefill chunk; the rest resume at 128."""
    rng = random.Random(seed)
    system = tokens(rng, 130)
    prompts = [system + tokens(rng, rng.randrange(64, 90)) for _ in range(5)]
    completions = engine.generate(prompts[:1], GREEDY) + engine.generate(prompts[1:2], GREEDY)
    completions += engine.generate(prompts[2:], GREEDY)
    engine.check_invariants()
    return [completion.token_ids for completion in completions]


@pytest.mark.gpu
def test_gpu_greedy_tokens_are_the_same_with_checkpoints_captured_inside_chunks(tiny_checkpoint):
    """On the GPU the compiled state-pass kernels capture the checkpoints: tokens equal to caching off."""
    off = GreedyMargins(engine_with(tiny_checkpoint, False, **ROOMY, device="cuda"))
    on = engine_with(tiny_checkpoint, True, **ROOMY, device="cuda")
    expected = long_shared_prefix(off, 1)
    assert min(off.gaps) > DECISIVE_LOGIT_GAP, "the workload meets a near-tie: the comparison would test rounding"
    assert long_shared_prefix(on, 1) == expected
    assert on.stats().prefix_cache_hits_by_kind.get("inside_prompt", 0) == 3 * 128
    assert_drained(on)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random add / burst / step / abort / preempt / evict on a small caching engine. After every rule the pools'
    invariants hold (reference counts equal the live requests' tables, LRU blocks unreferenced and hashed, checkpoint
    slots free, pending or keyed); a greedy prompt always gets the same tokens, whether it hit the cache or not."""

    folder: str = ""

    # Steps of 20 tokens chunk most prompts; steps of 80 take most whole, so checkpoints are captured inside chunks
    # (64 tokens from a chunk's start at the earliest) and requests admitted together wait for shared prefixes.
    @initialize(token_blocks=st.integers(10, 30), checkpoint_slots=st.integers(1, 4), interval=st.sampled_from([0, 32]),
                step_tokens=st.sampled_from([20, 80]))
    def setup(self, token_blocks, checkpoint_slots, interval, step_tokens):
        self.engine = engine_with(self.folder, True, 3, token_blocks, checkpoint_slots,
                                  max_num_batched_tokens=step_tokens, prefix_checkpoint_interval=interval)
        self.max_model_len = self.engine.max_model_len
        self.prefixes = [tokens(random.Random(seed), 96) for seed in range(2)]
        self.next_id = 0
        self.live: dict[str, tuple] = {}
        self.produced: dict[str, list[int]] = {}
        self.expected: dict[tuple, list[int]] = {}

    def _submit(self, prompt: list[int], max_tokens: int, salt: str | None, tail: int = 0) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        prompt = prompt[: self.max_model_len - max_tokens]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt,
                                resume_tail_tokens=min(tail, len(prompt) - 1))
        self.engine.add_request(request_id, prompt, params)
        self.live[request_id] = (tuple(prompt), max_tokens, salt)
        self.produced[request_id] = []

    @rule(prefix=st.integers(0, 1), prefix_len=st.integers(0, 96), suffix=st.lists(st.integers(0, VOCAB - 1),
          min_size=1, max_size=20), max_tokens=st.integers(1, 20), salt=st.sampled_from([None, "a"]),
          tail=st.sampled_from([0, 0, 1, TAIL]))
    def add(self, prefix, prefix_len, suffix, max_tokens, salt, tail):
        """A request; one with a tail (a re-rendering client's) keeps its prompt-end checkpoint while it runs."""
        self._submit(self.prefixes[prefix][:prefix_len] + suffix, max_tokens, salt, tail)

    @rule(prefix=st.integers(0, 1), suffixes=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
          min_size=2, max_size=3), max_tokens=st.integers(1, 8))
    def burst(self, prefix, suffixes, max_tokens):
        """Requests behind one whole prefix at once: admitted together, the later ones wait for the first's."""
        for suffix in suffixes:
            self._submit(self.prefixes[prefix] + suffix, max_tokens, None)

    @rule(seed=st.integers(0, 1000))
    def evict(self, seed):
        """A long prompt of its own: its blocks and checkpoints push cached ones off the LRU lists."""
        self._submit(tokens(random.Random(seed + 10_000), self.max_model_len), 1, None)

    def _apply(self, outputs) -> None:
        for output in outputs:
            self.produced[output.request_id] += output.new_token_ids
            if output.finished:
                key = self.live.pop(output.request_id)
                produced = self.produced.pop(output.request_id)
                if output.finish_reason == "length":
                    assert self.expected.setdefault(key, produced) == produced

    @rule()
    def step(self):
        self._apply(self.engine.step())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort(request_id)
        self._apply(self.engine.step())

    @precondition(lambda self: self.engine.scheduler.running)
    @rule()
    def preempt(self):
        """Preempt the most recently admitted request, as a step short of blocks would."""
        scheduler = self.engine.scheduler
        scheduler._preempt(scheduler.running[-1])

    @invariant()
    def pools_consistent(self):
        self.engine.check_invariants()
        cache = self.engine.cache
        refs = cache.blocks.refs
        assert all(block not in refs for block in cache.blocks.cached_blocks)
        assert cache.blocks.num_used_blocks + cache.blocks.num_free_blocks == cache.blocks.token_blocks

    def teardown(self):
        while self.engine.has_unfinished_requests():
            self._apply(self.engine.step())
        assert_drained(self.engine)


@pytest.fixture
def prefix_machine(tiny_checkpoint, shared_prefix_wait):
    PrefixCacheMachine.folder = tiny_checkpoint
    return PrefixCacheMachine


def test_prefix_cache_pools_under_random_requests(prefix_machine):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(prefix_machine, settings=settings(max_examples=10, stateful_step_count=25,
                                                                deadline=None))


def test_get_capacity_and_metrics_report_the_prefix_cache(tiny_checkpoint):
    from types import SimpleNamespace

    from hybridkv.api import generation_pb2 as pb
    from hybridkv.sidecar.serving.metrics import _EngineStatsCollector
    from hybridkv.sidecar.serving.server import capacity_to_proto, params_from_proto

    engine = engine_with(tiny_checkpoint, True, **ROOMY)
    shared_document(engine, seed=8)
    report = capacity_to_proto(engine.capacity().to_dict())
    assert (report.checkpoint_slots, report.per_rank[0].checkpoint_slots, report.predicted.checkpoint_slots) == (
        12, 12, 12)
    assert report.checkpoint_pool_bytes == report.per_rank[0].checkpoint_pool_bytes > 0
    assert report.checkpoint_attention_tokens > 0
    assert report.usage.cached_token_blocks > 0 and report.usage.used_token_blocks == 0
    assert report.usage.used_checkpoint_slots > 0
    stats = engine.stats()
    collector = _EngineStatsCollector(SimpleNamespace(stats=stats), model_name="tiny-qwen3.5")
    families = {family.name: family for family in collector.collect()}
    hits = families["vllm:prefix_cache_hits"].samples[0]
    assert hits.value == stats.prefix_cache_hits_total > 0
    assert hits.labels == {"model_name": "tiny-qwen3.5"}  # the endpoint picker selects vLLM's series on it
    assert families["vllm:prefix_cache_queries"].samples[0].value == stats.prefix_cache_queries_total
    kinds = {sample.labels["kind"]: sample.value for sample in families["hybridkv:prefix_cache_hits_by_kind"].samples}
    assert kinds["prompt_end"] == stats.prefix_cache_hits_total and kinds["output_end"] == 0
    assert families["hybridkv:checkpoint_slots_total"].samples[0].value == 12
    waits = families["hybridkv:prefix_cache_shared_prefix_waits"].samples[0]
    assert waits.value == stats.shared_prefix_waits_total == engine.scheduler.shared_prefix_waits_total
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), cache_salt="tenant-a", resume_tail_tokens=1)
    assert (params_from_proto(request).cache_salt, params_from_proto(request).resume_tail_tokens) == ("tenant-a", 1)
    plain = params_from_proto(pb.GenerateRequest(text="hi"))
    assert (plain.cache_salt, plain.resume_tail_tokens) == (None, 0)


def _keyed(pool, key: bytes, kind=None, shared: bool = False) -> int:
    from hybridkv.sidecar.core.cache import CheckpointKind

    slot = pool.reserve()
    pool.settle(slot, key, kind or CheckpointKind.PROMPT_END, shared)
    return slot


def test_checkpoints_used_twice_outlive_a_stream_of_one_off_ones():
    """A segmented LRU: a document's checkpoint used twice is protected, and the prompt-end checkpoints of one-off
    questions evict each other instead of it; a chat turn's checkpoint used once by the next turn is not."""
    from hybridkv.sidecar.core.cache import CheckpointPool

    pool = CheckpointPool(4)
    assert pool.protected_limit == 3
    _keyed(pool, b"document")
    _keyed(pool, b"chat turn")
    pool.touch(b"document")
    pool.touch(b"document")
    pool.touch(b"chat turn")
    assert pool.num_protected == 1
    for index in range(10):
        _keyed(pool, b"question %d" % index)
        pool.check()
    assert b"document" in pool and b"chat turn" not in pool
    assert pool.keys == [b"question 7", b"question 8", b"question 9", b"document"]  # next to be evicted first


def test_a_checkpoint_waiting_prompts_share_starts_protected_and_the_protected_list_is_bounded():
    from hybridkv.sidecar.core.cache import CheckpointPool

    pool = CheckpointPool(4)
    for name in (b"a", b"b", b"c", b"d"):
        _keyed(pool, name, shared=True)
        pool.check()
    # Three protected at most: the least recently used went back to probation, and goes first.
    assert pool.num_protected == 3 and pool.keys == [b"a", b"b", b"c", b"d"]
    _keyed(pool, b"e")
    assert b"a" not in pool and pool.keys == [b"e", b"b", b"c", b"d"]
    slot = pool.take_back(b"c")  # a protected one's slot taken back for rewriting
    assert pool.num_pending == 1 and pool.num_protected == 2
    pool.settle(slot, None, None)
    pool.check()
    # One slot leaves nothing to protect: plain LRU.
    single = CheckpointPool(1)
    _keyed(single, b"x", shared=True)
    single.touch(b"x")
    single.touch(b"x")
    assert single.num_protected == 0 and single.keys == [b"x"]
    _keyed(single, b"y")
    assert single.keys == [b"y"]


def test_kept_checkpoints_are_never_evicted_and_at_most_half_the_slots_are_kept():
    from hybridkv.sidecar.core.cache import CheckpointPool

    pool = CheckpointPool(4)
    for name in (b"a", b"b", b"c", b"d"):
        _keyed(pool, name)
    assert pool.pin(b"a") and pool.pin(b"a") and pool.pin(b"b")
    assert not pool.pin(b"c")  # two kept already: the limit
    assert not pool.pin(b"unknown")
    _keyed(pool, b"e")  # evicts the least recently used one not kept
    assert b"c" not in pool and pool.keys == [b"a", b"b", b"d", b"e"]
    pool.unpin(b"a")
    assert pool.pinned == {b"a": 1, b"b": 1}
    pool.check()
    pool.unpin(b"a")
    _keyed(pool, b"f")
    assert b"a" not in pool and pool.pinned == {b"b": 1}
    pool.check()


def test_a_refreshed_checkpoint_goes_last_without_counting_a_use():
    from hybridkv.sidecar.core.cache import CheckpointPool

    pool = CheckpointPool(4)
    for name in (b"a", b"b", b"c"):
        _keyed(pool, name)
    pool.refresh(b"a")
    pool.refresh(b"a")
    pool.refresh(b"gone")  # evicted meanwhile: nothing to do
    assert pool.keys == [b"b", b"c", b"a"] and pool.num_protected == 0
