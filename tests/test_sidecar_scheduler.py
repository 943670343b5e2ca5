"""Scheduler and pool bookkeeping without a model: every step's chunks obey the token budget, decodes come first,
admission is first come first served, preemption frees everything, and the pools' invariants hold after every step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.sidecar.core.cache import CacheManager, PoolInvariantError
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.core.scheduler import Scheduler
from hybridkv.sidecar.core.sequence import Sequence, SequenceStatus
from hybridkv.sidecar.execution.runner import StepBatch
from hybridkv.sizing import PoolShapes

SHAPES = PoolShapes(num_full_attention_layers=1, num_linear_attention_layers=1, kv_token_shape=(1, 2),
                    conv_slot_shape=(2, 3), ssm_slot_shape=(1, 2, 2), kv_dtype="float32", conv_dtype="float32",
                    ssm_dtype="float32")


def make_scheduler(token_blocks: int, state_slots: int, block_size: int, max_num_batched_tokens: int,
                   max_model_len: int | None = None):
    cache = CacheManager(token_blocks, state_slots, block_size, SHAPES, torch.device("cpu"))
    return Scheduler(cache, state_slots, max_num_batched_tokens, max_model_len or token_blocks * block_size)


def run_step(scheduler: Scheduler, next_token: int = 7) -> list:
    """What the engine does around the model: advance computed tokens, then hand the sampled tokens back."""
    chunks = scheduler.schedule()
    sampled = [chunk.seq for chunk in chunks if chunk.samples]
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.num_tokens
    for seq in sampled:
        seq.num_pending_tokens += 1
    scheduler.postprocess(sampled, [next_token] * len(sampled), [False] * len(sampled))
    return chunks


def new_seq(request_id: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first():
    scheduler = make_scheduler(token_blocks=64, state_slots=4, block_size=4, max_num_batched_tokens=8)
    scheduler.add(new_seq("a", 3))
    scheduler.add(new_seq("b", 20))
    first = run_step(scheduler)
    assert [(c.seq.request_id, c.num_tokens) for c in first] == [("a", 3), ("b", 5)]
    second = run_step(scheduler)
    # a decodes (1 token) before b continues its prompt with the rest of the budget.
    assert [(c.seq.request_id, c.num_tokens) for c in second] == [("a", 1), ("b", 7)]
    assert all(sum(c.num_tokens for c in run_step(scheduler)) <= 8 for _ in range(5))


def test_admission_needs_a_free_state_slot():
    scheduler = make_scheduler(token_blocks=64, state_slots=2, block_size=4, max_num_batched_tokens=64)
    for name in "abc":
        scheduler.add(new_seq(name, 5, max_tokens=3))
    run_step(scheduler)
    assert [s.request_id for s in scheduler.running] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    run_step(scheduler)
    assert [s.request_id for s in scheduler.waiting] == ["c"]  # blocks are plentiful; slots are not
    run_step(scheduler)  # a and b reach max_tokens and free their slots
    run_step(scheduler)
    assert [s.request_id for s in scheduler.running] == ["c"] and not scheduler.waiting


def test_admission_is_first_come_first_served_when_blocks_are_short():
    scheduler = make_scheduler(token_blocks=4, state_slots=4, block_size=4, max_num_batched_tokens=64)
    scheduler.add(new_seq("long", 12, max_tokens=1))
    scheduler.add(new_seq("longer", 13, max_tokens=1))
    scheduler.add(new_seq("short", 2, max_tokens=1))
    chunks = run_step(scheduler)
    # "longer" does not fit in the one block left; "short" would, but must not overtake it.
    assert [c.seq.request_id for c in chunks] == ["long"]


def test_preemption_frees_slot_and_blocks_and_requeues_at_the_front():
    scheduler = make_scheduler(token_blocks=4, state_slots=2, block_size=4, max_num_batched_tokens=64)
    old, young = new_seq("old", 7, max_tokens=8), new_seq("young", 7, max_tokens=8)
    scheduler.add(old)
    scheduler.add(young)
    run_step(scheduler)  # both prefill: 2 blocks each, pool full
    run_step(scheduler)  # both decode position 7 inside their second block
    run_step(scheduler)  # old needs a third block: young is preempted
    assert scheduler.preemptions_total == 1
    assert young.status is SequenceStatus.WAITING and scheduler.waiting[0] is young
    assert young.state_slot == 0 and not young.block_table and young.num_computed_tokens == 0
    assert young.num_completion_tokens == 2  # generated tokens are kept and recomputed with the prompt
    scheduler.cache.check_invariants(scheduler.live_sequences())
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert old.finish_reason == young.finish_reason == "length"
    assert young.num_completion_tokens == 8
    assert scheduler.cache.blocks.num_used_blocks == 0 and scheduler.cache.slots.num_used_slots == 0


def launch(chunks) -> None:
    """What the engine does when it launches a step without reading its tokens yet: the sampled ones are pending."""
    for chunk in chunks:
        sampled = chunk.samples
        chunk.seq.num_computed_tokens += chunk.num_tokens
        chunk.seq.num_pending_tokens += sampled


def test_a_pending_token_decodes_and_a_request_at_its_limit_is_not_scheduled_again():
    scheduler = make_scheduler(token_blocks=16, state_slots=2, block_size=4, max_num_batched_tokens=64,
                               max_model_len=7)
    short, long = new_seq("short", 3, max_tokens=2), new_seq("long", 5, max_tokens=10)
    scheduler.add(short)
    scheduler.add(long)
    launch(scheduler.schedule())
    # Both tokens are still on the device; both requests decode them in the next step.
    decodes = scheduler.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in decodes] == [("short", 1), ("long", 1)]
    launch(decodes)
    # short has its max_tokens (2) and long reaches max_model_len (7), counting pending tokens: neither runs again.
    assert scheduler.schedule() == []
    assert short.num_tokens == 5 and long.num_tokens == 7 and short.num_completion_tokens == 0


def test_a_preempted_request_with_a_pending_token_waits_for_it_and_can_finish_while_waiting():
    scheduler = make_scheduler(token_blocks=16, state_slots=2, block_size=4, max_num_batched_tokens=64)
    first, second = new_seq("first", 3), new_seq("second", 3)
    first.num_pending_tokens = 1  # sampled before its preemption, not yet read
    scheduler.add(first)
    scheduler.add(second)
    # Its recompute needs the id on the host: nobody is admitted past it (first come, first served) until then.
    assert scheduler.schedule() == [] and list(scheduler.waiting) == [first, second]
    first.num_pending_tokens = 0
    first.token_ids.append(9)
    assert [(c.seq.request_id, c.num_tokens) for c in scheduler.schedule()] == [("first", 4), ("second", 3)]
    scheduler.finish(first, "stop")
    waiting = new_seq("waiting", 2)
    scheduler.add(waiting)
    scheduler.finish(waiting, "stop")  # the token read after its preemption was a stop token
    assert waiting.finished and not scheduler.waiting and scheduler.running == [second]
    scheduler.cache.check_invariants(scheduler.live_sequences())


def test_allocated_state_slot_is_zeroed_by_the_step_that_first_runs_it():
    scheduler = make_scheduler(token_blocks=8, state_slots=2, block_size=4, max_num_batched_tokens=8)
    first = new_seq("first", 2, max_tokens=2)
    scheduler.add(first)
    run_step(scheduler)
    conv_state, ssm_state = scheduler.cache.state_caches[0]
    conv_state.fill_(3.0)
    ssm_state.fill_(3.0)
    second = new_seq("second", 2, max_tokens=1)
    scheduler.add(second)
    chunks = scheduler.schedule()
    # The decode of `first` keeps its slot; the batch names `second`'s new slot, which every rank zeroes before it runs.
    batch = StepBatch.from_chunks(chunks)
    assert second.state_slot == 2 and batch.fresh_slots == [2]
    scheduler.cache.zero_slots(batch.fresh_slots)
    assert conv_state[2].abs().sum() == 0 and ssm_state[2].abs().sum() == 0
    assert conv_state[1].abs().sum() > 0 and conv_state[0].abs().sum() > 0  # only the fresh slot is zeroed


def test_double_free_is_detected():
    scheduler = make_scheduler(token_blocks=8, state_slots=2, block_size=4, max_num_batched_tokens=8)
    seq = new_seq("a", 5)
    scheduler.add(seq)
    scheduler.schedule()
    blocks, slot = list(seq.block_table), seq.state_slot
    scheduler.cache.release(seq)
    with pytest.raises(PoolInvariantError):
        scheduler.cache.blocks.free(blocks)
    with pytest.raises(PoolInvariantError):
        scheduler.cache.slots.free(slot)
    with pytest.raises(PoolInvariantError):
        scheduler.cache.blocks.free([0])


def test_invariant_check_catches_a_leak():
    scheduler = make_scheduler(token_blocks=8, state_slots=2, block_size=4, max_num_batched_tokens=8)
    seq = new_seq("a", 5)
    scheduler.add(seq)
    scheduler.schedule()
    seq.block_table.pop()  # the request forgets a block it holds
    with pytest.raises(PoolInvariantError):
        scheduler.cache.check_invariants(scheduler.live_sequences())


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort sequences against small pools; the invariants hold after every rule."""

    @initialize(token_blocks=st.integers(4, 24), state_slots=st.integers(1, 4), block_size=st.sampled_from([1, 2, 4]),
                extra_budget=st.integers(0, 12), hold_tokens=st.sampled_from([0, 8, 40]), wait_steps=st.integers(0, 3))
    def setup(self, token_blocks, state_slots, block_size, extra_budget, hold_tokens, wait_steps):
        self.scheduler = make_scheduler(token_blocks, state_slots, block_size, state_slots + extra_budget)
        self.scheduler.min_prefill_tokens_with_decodes = hold_tokens
        self.scheduler.max_prefill_wait_steps = wait_steps
        self.capacity_tokens = token_blocks * block_size
        self.next_id = 0
        self.finished: list[Sequence] = []

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 8))
    def add(self, prompt_len, max_tokens):
        # The engine refuses requests longer than the token pool (max_model_len <= token capacity).
        prompt_len = min(prompt_len, self.capacity_tokens - 1)
        max_tokens = min(max_tokens, self.capacity_tokens - prompt_len)
        self.scheduler.add(new_seq(f"r{self.next_id}", prompt_len, max_tokens))
        self.next_id += 1

    @rule()
    def step(self):
        budget = self.scheduler.max_num_batched_tokens
        idle_head = self.scheduler.waiting[0] if self.scheduler.waiting and not self.scheduler.running else None
        chunks = run_step(self.scheduler)
        if idle_head is not None:  # nothing running and requests pending: the head must start (no deadlock)
            assert any(chunk.seq is idle_head for chunk in chunks)
        assert sum(c.num_tokens for c in chunks) <= budget
        one_token = [c.num_tokens == 1 for c in chunks]
        assert one_token == sorted(one_token, reverse=True)  # 1-token steps first
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        # Waiting prompts are never held longer than the wait steps.
        assert self.scheduler.held_steps <= self.scheduler.max_prefill_wait_steps

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        live = self.scheduler.live_sequences()
        victim = data.draw(st.sampled_from(live))
        assert self.scheduler.abort(victim.request_id) is victim
        assert victim.finish_reason == "abort" and victim.state_slot == 0 and not victim.block_table

    @invariant()
    def pools_consistent(self):
        self.scheduler.cache.check_invariants(self.scheduler.live_sequences())

TestSchedulerMachine = SchedulerMachine.TestCase


def test_postprocess_finishes_on_a_stop_and_at_the_length_limit_and_frees_at_once():
    scheduler = make_scheduler(token_blocks=8, state_slots=3, block_size=4, max_num_batched_tokens=16,
                               max_model_len=6)
    stopped, capped, by_model_len = new_seq("stop", 2), new_seq("max-tokens", 2, max_tokens=1), new_seq("len", 5)
    for seq in (stopped, capped, by_model_len):
        scheduler.add(seq)
    chunks = scheduler.schedule()
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.num_tokens
        chunk.seq.num_pending_tokens += 1
    reasons = scheduler.postprocess([stopped, capped, by_model_len], [3, 4, 5], [True, False, False])
    assert reasons == ["stop", "length", "length"]
    assert all(seq.finished and seq.state_slot == 0 and not seq.block_table for seq in (stopped, capped, by_model_len))
    assert scheduler.cache.slots.num_used_slots == 0 and scheduler.cache.blocks.num_used_blocks == 0
    scheduler.cache.check_invariants(scheduler.live_sequences())


def test_prefill_chunks_share_a_smaller_budget_while_decodes_run():
    cache_blocks, block_size = 32, 4
    scheduler = make_scheduler(token_blocks=cache_blocks, state_slots=4, block_size=block_size,
                               max_num_batched_tokens=64)
    scheduler.max_prefill_tokens_with_decodes = 6
    alone = new_seq("alone", 20, max_tokens=8)
    scheduler.add(alone)
    # No decode runs yet: the prompt gets the whole step budget.
    assert [(c.seq.request_id, c.num_tokens) for c in run_step(scheduler)] == [("alone", 20)]
    late, later = new_seq("late", 20), new_seq("later", 20)
    scheduler.add(late)
    scheduler.add(later)
    # `alone` decodes now: the two prompts share 6 prefill tokens, the first one taking them all.
    assert [(c.seq.request_id, c.num_tokens) for c in run_step(scheduler)] == [("alone", 1), ("late", 6)]
    assert [(c.seq.request_id, c.num_tokens) for c in run_step(scheduler)] == [("alone", 1), ("late", 6)]
    scheduler.cache.check_invariants(scheduler.live_sequences())


def hold_scheduler(min_tokens: int, wait_steps: int, decoders: int = 0) -> Scheduler:
    """A scheduler that holds prefill back, with `decoders` requests past their prefill and decoding."""
    scheduler = make_scheduler(token_blocks=128, state_slots=10, block_size=4, max_num_batched_tokens=64)
    scheduler.min_prefill_tokens_with_decodes = min_tokens
    scheduler.max_prefill_wait_steps = wait_steps
    for index in range(decoders):
        scheduler.add(new_seq(f"decoding-{index}", 4, max_tokens=40))
    if decoders:
        run_step(scheduler)  # nothing decodes yet: all are admitted at once
    return scheduler


def prefills(chunks) -> list[tuple[str, int]]:
    """The step's chunks other than the decoders' one-token steps."""
    return [(chunk.seq.request_id, chunk.num_tokens) for chunk in chunks
            if not chunk.seq.request_id.startswith("decoding-")]


def test_while_decodes_run_a_short_prompt_waits_at_most_the_wait_steps():
    scheduler = hold_scheduler(min_tokens=16, wait_steps=3, decoders=6)
    scheduler.add(new_seq("short", 5))
    # Three steps of decodes only hold it (5 < 16 tokens ready), the fourth admits it.
    held = [run_step(scheduler) for _ in range(3)]
    assert [prefills(chunks) for chunks in held] == [[]] * 3 and all(len(chunks) == 6 for chunks in held)
    assert prefills(run_step(scheduler)) == [("short", 5)]
    assert scheduler.held_steps_total == 3 and scheduler.held_steps == 0
    scheduler.cache.check_invariants(scheduler.live_sequences())


def test_beside_few_decodes_a_prompt_is_held_one_step_per_two_decoding_requests():
    scheduler = hold_scheduler(min_tokens=16, wait_steps=32, decoders=3)
    scheduler.add(new_seq("short", 5))
    assert [prefills(run_step(scheduler)) for _ in range(3)] == [[], [], [("short", 5)]]
    assert scheduler.held_steps_total == 2  # ceil(3 / 2)


def test_prompts_that_reach_the_minimum_together_are_admitted_together():
    scheduler = hold_scheduler(min_tokens=16, wait_steps=8, decoders=4)
    scheduler.add(new_seq("first", 10))
    assert prefills(run_step(scheduler)) == []
    scheduler.add(new_seq("second", 6))  # 16 tokens ready now
    assert prefills(run_step(scheduler)) == [("first", 10), ("second", 6)]
    assert scheduler.held_steps_total == 1


def test_nothing_is_held_without_decodes_or_with_the_minimum_at_zero():
    scheduler = hold_scheduler(min_tokens=16, wait_steps=8)
    scheduler.add(new_seq("alone", 5))
    assert prefills(run_step(scheduler)) == [("alone", 5)]  # no decode to protect
    scheduler = hold_scheduler(min_tokens=0, wait_steps=8, decoders=4)
    scheduler.add(new_seq("short", 2))
    assert prefills(run_step(scheduler)) == [("short", 2)]
    assert scheduler.held_steps_total == 0


def test_a_prefill_under_way_runs_on_while_a_short_prompt_is_held():
    scheduler = hold_scheduler(min_tokens=16, wait_steps=2, decoders=4)
    scheduler.max_prefill_tokens_with_decodes = 6
    scheduler.add(new_seq("long", 20))
    assert prefills(run_step(scheduler)) == [("long", 6)]  # 20 >= 16 ready
    scheduler.add(new_seq("short", 3))
    # 14 + 3 ready: not held, but `long` takes the step's 6 prefill tokens.
    assert prefills(run_step(scheduler)) == [("long", 6)]
    # 8 + 3, then 2 + 3 ready: `short` is held while `long` runs on, until it has waited two steps.
    assert prefills(run_step(scheduler)) == [("long", 6)]
    assert prefills(run_step(scheduler)) == [("long", 2)]
    assert prefills(run_step(scheduler)) == [("long", 1), ("short", 3)]
    assert scheduler.held_steps_total == 2
    scheduler.cache.check_invariants(scheduler.live_sequences())


def admitted(chunks) -> list[tuple[str, int]]:
    """The step's prompt chunks (every other chunk is a one-token decode)."""
    return [(chunk.seq.request_id, chunk.num_tokens) for chunk in chunks if chunk.num_tokens > 1]


class StepClock:
    """A clock the test advances by each step's cost: pure decode steps `decode_s`, steps with prefill `mixed_s`."""

    def __init__(self, decode_s: float, mixed_s: float):
        self.now, self.decode_s, self.mixed_s = 1000.0, decode_s, mixed_s

    def __call__(self) -> float:
        return self.now

    def run(self, scheduler: Scheduler) -> list:
        chunks = run_step(scheduler)
        self.now += self.decode_s if all(chunk.num_tokens == 1 for chunk in chunks) else self.mixed_s
        return chunks


def tpot_scheduler(target_s: float, clock: StepClock, decoders: int = 0, steps: int = 0) -> Scheduler:
    """A scheduler with a TPOT target on `clock`, `decoders` requests prefilled and then `steps` more steps run."""
    scheduler = make_scheduler(token_blocks=256, state_slots=16, block_size=4, max_num_batched_tokens=64)
    scheduler.target_tpot_s, scheduler.clock = target_s, clock
    for index in range(decoders):
        scheduler.add(new_seq(f"decoding-{index}", 4, max_tokens=200))
    for _ in range(steps + bool(decoders)):
        clock.run(scheduler)
    return scheduler


def test_a_tpot_target_holds_new_prompts_until_the_recent_steps_are_under_it():
    clock = StepClock(decode_s=0.010, mixed_s=0.100)
    scheduler = tpot_scheduler(0.021, clock, decoders=2, steps=4)  # pure decode steps of 10 ms: under the target
    scheduler.add(new_seq("first", 8))
    assert admitted(clock.run(scheduler)) == [("first", 8)]  # admitted: a 100 ms mixed step
    scheduler.add(new_seq("second", 8))
    # The window now averages (4 x 10 + 100) / 5 = 28 ms: `second` waits while 10 ms decode steps bring it down,
    # (40 + 100 + 10 k) / (5 + k) under 21 ms after k = 4 more (21.25 ms after 3).
    held = [admitted(clock.run(scheduler)) for _ in range(4)]
    assert held == [[]] * 4 and scheduler.tpot_held_steps_total == 4
    assert admitted(clock.run(scheduler)) == [("second", 8)]
    assert scheduler.tpot_held_steps_total == 4 and scheduler.held_steps_total == 0
    scheduler.cache.check_invariants(scheduler.live_sequences())


def test_a_tpot_target_holds_nothing_that_shedding_could_not_help():
    # Pure decode steps over the target: holding prompts back would not bring the steps under it.
    clock = StepClock(decode_s=0.030, mixed_s=0.100)
    scheduler = tpot_scheduler(0.020, clock, decoders=2, steps=4)
    scheduler.add(new_seq("late", 8))
    assert admitted(clock.run(scheduler)) == [("late", 8)]
    # No request decoding: nothing to protect, whatever the steps took.
    clock = StepClock(decode_s=0.010, mixed_s=0.500)
    scheduler = tpot_scheduler(0.020, clock)
    scheduler.add(new_seq("long", 200))
    for _ in range(3):
        clock.run(scheduler)
    scheduler.add(new_seq("next", 8))
    assert ("next", 8) in admitted(clock.run(scheduler))
    assert scheduler.tpot_held_steps_total == 0


def test_the_tpot_window_forgets_old_steps_and_idle_time():
    clock = StepClock(decode_s=0.010, mixed_s=0.100)
    scheduler = tpot_scheduler(0.020, clock, decoders=1, steps=3)
    scheduler.add(new_seq("first", 8))
    clock.run(scheduler)  # a 100 ms mixed step: the window averages 32.5 ms
    clock.now += 5.0  # the window's steps all began more than two seconds ago
    scheduler.add(new_seq("second", 8))
    assert ("second", 8) in admitted(clock.run(scheduler))
    # The engine idles once every request has finished; that wait is no step's time.
    scheduler = tpot_scheduler(0.020, StepClock(decode_s=0.010, mixed_s=0.010))
    scheduler.add(new_seq("only", 4, max_tokens=6))
    while scheduler.has_unfinished():
        scheduler.clock.run(scheduler)
    scheduler.clock.now += 1.0
    scheduler.add(new_seq("after", 4, max_tokens=6))
    scheduler.clock.run(scheduler)
    assert all(seconds < 0.5 for _, seconds, _ in scheduler._decode_steps)
    assert scheduler.tpot_held_steps_total == 0


def test_without_a_tpot_target_the_clock_is_never_read():
    scheduler = make_scheduler(token_blocks=64, state_slots=4, block_size=4, max_num_batched_tokens=64)
    scheduler.clock = lambda: pytest.fail("the clock was read without a TPOT target")
    scheduler.add(new_seq("a", 4))
    for _ in range(3):
        run_step(scheduler)
    assert scheduler.tpot_held_steps_total == 0
