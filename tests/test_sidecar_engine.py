"""The engine end to end on a tiny random checkpoint: Hugging Face-exact greedy output (batched, chunked, preempted),
sampling semantics, stop conditions, usage, aborts, thread safety, start-up refusals, and pool invariants under random
add / step / abort sequences."""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import replace

import pytest
import torch
from engine_fixtures import (  # noqa: F401 (fixtures)
    hf_greedy,
    hf_model,
    load_hf_model,
    make_engine,
    pool_budget,
    tiny_checkpoint,
)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sidecar_model_harness import TF32_SPREADS, tf32_spread

from hybridkv.errors import UserError
from hybridkv.sidecar.core.config import EngineConfig
from hybridkv.sidecar.core.engine import Engine
from hybridkv.sidecar.execution.runner import PENDING_TOKEN, StepBatch
from hybridkv.sidecar.core.sampler import Sampler
from hybridkv.sidecar.core.sampling import RequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# fp32 on both sides; the engine's chunked/recurrent GDN and paged attention reorder sums, nothing more.
LOGITS_ATOL = 1e-3  # measured differences are about 1.5e-4 on logits with a standard deviation of 8


def prompts_of_lengths(lengths: list[int], seed: int, vocab: int = 500) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def run_checked(engine: Engine, prompts: list[list[int]], params) -> list:
    """generate(), with the pool invariants checked after every step."""
    step = engine.step

    def checked_step():
        outputs = step()
        engine.check_invariants()
        return outputs

    engine.step = checked_step
    try:
        return engine.generate(prompts, params)
    finally:
        engine.step = step


def generate_recording_logits(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """Run `prompts` to completion; returns each prompt's generated tokens and the float32 logits each token was
    sampled from ([tokens, vocab]), matched to requests through their state slots."""
    logits_by_request: dict[str, list[torch.Tensor]] = {f"p{i}": [] for i in range(len(prompts))}
    execute = engine.runner.execute

    def recording_execute(batch, *args):
        # Before the launch: a request the previous step's ids finish during it leaves the running list then.
        owner = {seq.state_slot: seq.request_id for seq in engine.scheduler.running}
        logits = execute(batch, *args)
        for row, seq_index in enumerate(batch.sample_indices):
            logits_by_request[owner[batch.state_slots[seq_index]]].append(logits[row].float().cpu())
        return logits

    engine.runner.execute = recording_execute
    tokens: dict[str, list[int]] = {request_id: [] for request_id in logits_by_request}
    try:
        for index, prompt in enumerate(prompts):
            engine.add_request(f"p{index}", prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id].extend(output.new_token_ids)
    finally:
        engine.runner.execute = execute
    return [tokens[f"p{i}"] for i in range(len(prompts))], [
        torch.stack(logits_by_request[f"p{i}"]) for i in range(len(prompts))]


MIXED_LENGTHS = [1, 5, 17, 31, 40, 64]
# GPU tests compute in float32: a random 32-layer stack amplifies bf16 rounding so much that transformers' own bf16
# and float32 runs pick different greedy tokens at about half the positions, which would make bf16 equality
# meaningless. fla's chunk kernel runs float32 dots in TF32 (some explicitly), hence a looser bound
# than on CPU: GPU_LOGITS_ATOL, or what TF32 matmuls move transformers' own logits by on the same tokens if larger.
GPU_LOGITS_ATOL = 2e-2  # logits have a standard deviation of about 8
# A divergence is excused only where transformers' two best logits are closer than both sides' errors can explain.
NEAR_TIE_LOGITS = 4 * GPU_LOGITS_ATOL


@pytest.mark.parametrize(
    "settings_",
    [
        pytest.param({}, id="one-step-prefill"),
        pytest.param({"max_num_batched_tokens": 8, "max_num_seqs": 4}, id="chunked-prefill"),
        # 20 blocks of 4 tokens hold 80 tokens; the batch needs about 230: requests are preempted and recomputed.
        pytest.param({"block_size": 4, "max_num_seqs": 6, "max_model_len": 80,
                      "kv_cache_memory_bytes": ("budget", 6, 20, 4)}, id="preemption"),
    ],
)
def test_greedy_tokens_equal_transformers(tiny_checkpoint, hf_model, settings_, seed):
    settings_ = dict(settings_)
    if isinstance(settings_.get("kv_cache_memory_bytes"), tuple):
        settings_["kv_cache_memory_bytes"] = pool_budget(tiny_checkpoint, *settings_["kv_cache_memory_bytes"][1:])
    engine = make_engine(tiny_checkpoint, **settings_)
    prompts = prompts_of_lengths(MIXED_LENGTHS, seed)
    completions = run_checked(engine, prompts, GREEDY)
    for prompt, completion in zip(prompts, completions):
        expected, _ = hf_greedy(hf_model, prompt, GREEDY.max_tokens)
        assert completion.token_ids == expected, f"prompt of {len(prompt)} tokens"
    if "block_size" in settings_:
        assert engine.stats().preemptions_total > 0
    assert engine.stats().used_token_blocks == 0 and engine.stats().used_state_slots == 0


def test_logits_match_transformers(tiny_checkpoint, hf_model, seed):
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=16)
    prompts = prompts_of_lengths([37, 3, 20], seed)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    all_tokens, all_logits = generate_recording_logits(engine, prompts, params)
    for prompt, tokens, logits in zip(prompts, all_tokens, all_logits):
        with torch.inference_mode():
            expected = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
        torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
        assert tokens == expected.argmax(dim=-1).tolist()


def test_output_depends_on_the_prompt(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint)
    prompts = prompts_of_lengths([9, 9, 9, 9], seed)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = [tuple(c.token_ids) for c in engine.generate(prompts, params)]
    assert len(set(outputs)) == len(outputs)
    assert all(len(set(tokens)) > 1 for tokens in outputs)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint)
    prompt = prompts_of_lengths([12], seed)[0]
    others = prompts_of_lengths([3, 20, 7], seed + 1)
    params = SamplingParams(temperature=2.0, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)
    alone = engine.generate([prompt], params)[0].token_ids
    unseeded = SamplingParams(temperature=2.0, max_tokens=16, ignore_eos=True)
    in_batch = engine.generate([*others, prompt], [unseeded] * 3 + [params])[-1].token_ids
    assert alone == in_batch
    other_seed = engine.generate([prompt], SamplingParams(temperature=2.0, top_p=0.95, seed=seed + 1, max_tokens=16,
                                                          ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint)
    prompts = prompts_of_lengths([4, 11], seed)
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    top1 = engine.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))
    assert [c.token_ids for c in greedy] == [c.token_ids for c in top1]


def test_generate_returns_the_logprobs_a_request_asked_for(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint)
    prompts = prompts_of_lengths([6, 13], seed)
    asked = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    with_logprobs, without = engine.generate(prompts, [asked, replace(asked, logprobs=None)])
    assert without.logprobs is None
    assert len(with_logprobs.logprobs) == 5
    for token, logprobs in zip(with_logprobs.token_ids, with_logprobs.logprobs):
        assert len(logprobs.top) == 2 and logprobs.top[0] == (token, logprobs.logprob)  # greedy: the most likely


def test_stop_strings_stop_token_ids_max_tokens_and_usage(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint)
    prompt = prompts_of_lengths([6], seed)[0]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert free.finish_reason == "length" and free.completion_tokens == 24 == len(free.token_ids)
    assert free.prompt_tokens == 6
    assert free.text == engine.tokenizer.decode(free.token_ids)

    stop_token = free.token_ids[5]
    by_id = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                     stop_token_ids=[stop_token]))[0]
    first = free.token_ids.index(stop_token)
    assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish_reason == "stop"

    stop_text = free.text[len(free.text) // 2: len(free.text) // 2 + 3]
    by_text = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                       stop=[stop_text]))[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == free.text[: free.text.index(stop_text)]
    assert by_text.token_ids == free.token_ids[: len(by_text.token_ids)]

    stats = engine.stats()
    assert stats.generation_tokens_total == 24 + len(by_id.token_ids) + len(by_text.token_ids)
    assert stats.prompt_tokens_total == 3 * 6


def test_eos_stops_unless_ignored(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint)
    assert engine.tokenizer.eos_token_ids  # read from the checkpoint's configs
    # Random weights rarely emit the real eos; declare a token the greedy run emits as the eos id instead.
    prompt = prompts_of_lengths([6], seed)[0]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    engine.tokenizer.eos_token_ids = (free.token_ids[3],)
    stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[3]) + 1]
    ignored = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids


def run_outputs(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Each request's streamed tokens and text, finish reason and usage, with the invariants checked every step."""
    streamed: dict[str, list] = {f"o{i}": [[], "", None, None] for i in range(len(prompts))}
    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"o{index}", prompt, request_params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            record = streamed[output.request_id]
            record[0] += output.new_token_ids
            record[1] += output.text_delta
            if output.finished:
                record[2:] = [output.finish_reason, (output.prompt_tokens, output.completion_tokens)]
        engine.check_invariants()
    return streamed


def test_the_previous_steps_outputs_go_to_the_sink_between_two_layers_of_the_next_launch(tiny_checkpoint, seed):
    """On CPU a step has finished when its launch returns, so the next launch reads it at its first layer: its
    outputs reach `output_sink` while that launch is under way, step() does not return them again, and every
    request's tokens, text and finish are those of serial steps (requests stopped by a token read mid-launch
    included)."""
    budget = pool_budget(tiny_checkpoint, 6, 16, 4)
    settings_ = dict(block_size=4, max_num_seqs=6, max_model_len=64, kv_cache_memory_bytes=budget)
    prompts = prompts_of_lengths([3, 9, 17, 30], seed)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 7, 12, 5)]
    serial = make_engine(tiny_checkpoint, **settings_)
    serial.overlap_steps = False
    expected = run_outputs(serial, prompts, params)
    engine = make_engine(tiny_checkpoint, **settings_)
    launching, sunk, returned = [False], [], []
    execute = engine.runner.execute

    def marking_execute(batch, *args):
        launching[0] = True
        try:
            return execute(batch, *args)
        finally:
            launching[0] = False

    def sink(outputs):
        assert launching[0], "outputs read outside a launch went to the sink"
        sunk.extend(outputs)

    engine.runner.execute = marking_execute
    engine.output_sink = sink
    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"o{index}", prompt, request_params)
    while engine.has_unfinished_requests():
        returned.extend(engine.step())
        engine.check_invariants()
    got = {f"o{i}": [[], "", None] for i in range(len(prompts))}
    for output in sunk + returned:  # a request's outputs in order: the sink's come first within a step
        got[output.request_id][0] += output.new_token_ids
        got[output.request_id][1] += output.text_delta
        if output.finished:
            got[output.request_id][2] = output.finish_reason
    assert got == {key: value[:3] for key, value in expected.items()}
    assert len(sunk) > len(returned) > 0  # most steps' outputs went out mid-launch; the last step's after it
    assert engine.stats().used_state_slots == 0


def test_on_a_gpu_only_steps_run_piecewise_read_between_layers(tiny_checkpoint, seed):
    """A GPU engine reads the step in flight between two layers of a launch only where that launch runs through the
    piecewise graphs (the host's bound); a larger, eager prefill step and a serial or idle engine read after."""
    engine = make_engine(tiny_checkpoint)
    batch = object()
    assert not engine._reads_between_layers(batch)  # nothing in flight
    engine._launched = object()
    assert engine._reads_between_layers(batch)  # CPU: every step
    engine.device = torch.device("cuda")
    for piecewise in (True, False):
        engine.runner.runs_piecewise = lambda _batch, piecewise=piecewise: piecewise
        assert engine._reads_between_layers(batch) is piecewise
    engine.overlap_steps = False
    assert not engine._reads_between_layers(batch)


def test_overlapped_steps_change_no_output(tiny_checkpoint, seed):
    """Launching step n+1 before reading step n's ids changes nothing a client sees: the same tokens, text, finish
    reasons and usage as serial steps, under preemption, with stop ids, eos, stop strings and seeded sampling."""
    budget = pool_budget(tiny_checkpoint, 6, 16, 4)
    settings_ = dict(block_size=4, max_num_seqs=6, max_model_len=64, kv_cache_memory_bytes=budget)
    prompts = prompts_of_lengths([1, 5, 17, 31, 40, 44], seed)
    serial = make_engine(tiny_checkpoint, **settings_)
    serial.overlap_steps = False
    free = run_outputs(serial, prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 6)
    first_tokens = free["o0"][0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(first_tokens[4],)),
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=16, seed=seed % 1000),
        SamplingParams(temperature=0.0, max_tokens=12, stop=(free["o2"][1][3:5],)),
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=16, seed=seed % 1000 + 1),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    serial.tokenizer.eos_token_ids = (free["o5"][0][6],)
    expected = run_outputs(serial, prompts, params)
    overlapped = make_engine(tiny_checkpoint, **settings_)
    overlapped.tokenizer.eos_token_ids = serial.tokenizer.eos_token_ids
    assert overlapped.overlap_steps
    pending_rows = []
    execute = overlapped.runner.execute

    def counting_execute(batch, *args):
        pending_rows.append(sum(token == PENDING_TOKEN for token in batch.input_ids))
        return execute(batch, *args)

    overlapped.runner.execute = counting_execute
    assert run_outputs(overlapped, prompts, params) == expected
    assert sum(pending_rows) > 0 and overlapped.stats().preemptions_total > 0
    assert [expected[f"o{i}"][2] for i in (0, 2, 3, 5)] == ["stop", "stop", "length", "stop"]



@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_reading_a_finished_step_before_launching_a_prefill_step_changes_no_output(tiny_checkpoint, seed, caching):
    """On a GPU a step with prefill is read early when the device has already finished the step before it (its
    launches take longer on the host). Forced here at every such step: the same outputs as serial steps, and a
    request that its token finished leaves the step it was scheduled into."""
    checkpoints = 4 if caching else 0  # a checkpoint slot costs one request's state
    state_bytes = pool_budget(tiny_checkpoint, 1, 0, 4) - pool_budget(tiny_checkpoint, 0, 0, 4)
    budget = pool_budget(tiny_checkpoint, 6, 24, 4) + checkpoints * state_bytes
    prefix = dict(enable_prefix_caching=True, prefix_checkpoint_slots=checkpoints) if caching else {}
    settings_ = dict(block_size=4, max_num_seqs=6, max_model_len=64, kv_cache_memory_bytes=budget,
                     max_num_batched_tokens=16, **prefix)
    shared = prompts_of_lengths([16], seed + 1)[0]  # a common prefix, for the prefix cache to hit
    prompts = [shared + prompt for prompt in prompts_of_lengths([1, 5, 9, 15, 20, 28], seed)]
    serial = make_engine(tiny_checkpoint, **settings_)
    serial.overlap_steps = False
    free = run_outputs(serial, prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 6)
    # Stops by token id, which the scheduler cannot see coming (a length limit it can: it schedules no such row).
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(free[f"o{index}"][0][position],))
              for index, position in enumerate((1, 2, 5, 1, 3, 7))]
    params[4] = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5, seed=seed % 1000)
    expected = run_outputs(serial, prompts, params)
    early = make_engine(tiny_checkpoint, **settings_)
    asked = []
    early._device_finished = lambda launched: asked.append(launched) or True
    scheduled, launched_rows = [], []
    schedule, launch = early.scheduler.schedule, early._launch
    early.scheduler.schedule = lambda: scheduled.append(schedule()) or scheduled[-1]
    early._launch = lambda chunks: launched_rows.append(len(chunks)) or launch(chunks)
    assert run_outputs(early, prompts, params) == expected
    assert asked, "no step with prefill followed a launched step"
    # Every step that scheduled chunks launched (a prefill chunk always stays).
    scheduled = [chunks for chunks in scheduled if chunks]
    assert len(scheduled) == len(launched_rows)
    assert any(len(chunks) > rows for chunks, rows in zip(scheduled, launched_rows)), "no finished row left a step"
    stats = early.stats()
    assert stats.running == 0 and stats.used_state_slots == 0
    assert (stats.prefix_cache_hits_total > 0) == caching


def test_abort_frees_the_request_at_the_next_step(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint)
    prompt = prompts_of_lengths([10], seed)[0]
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats().used_state_slots == 1
    assert engine.abort("a") is True
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("a", True, "abort")]
    assert engine.stats().used_state_slots == 0 and engine.stats().used_token_blocks == 0
    assert engine.abort("a") is False and not engine.has_unfinished_requests()


def test_add_request_from_another_thread_while_stepping(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint)
    prompts = prompts_of_lengths([3, 8, 13, 5, 9, 2], seed)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    done: dict[str, int] = {}

    def producer():
        for index, prompt in enumerate(prompts):
            engine.add_request(f"t{index}", prompt, params)

    thread = threading.Thread(target=producer)
    thread.start()
    while thread.is_alive() or engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.completion_tokens
        engine.check_invariants()
    thread.join()
    assert done == {f"t{index}": 6 for index in range(len(prompts))}


def test_invalid_requests_are_refused_and_change_nothing(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, max_model_len=32)
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("long", [5] * 30, SamplingParams(max_tokens=3))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("vocab", [10**6], SamplingParams(max_tokens=3))
    with pytest.raises(RequestError, match="top_p"):
        engine.add_request("topp", [5], SamplingParams(top_p=0.0))
    engine.add_request("ok", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("ok", [5, 6], SamplingParams(max_tokens=2))
    assert engine.stats().waiting == 0  # nothing reached the scheduler before a step
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["ok"]


@pytest.mark.parametrize("bad", [True, -1, 512, 2.0, "7", None], ids=repr)
def test_every_prompt_id_must_be_a_plain_int_in_the_vocabulary(bad):
    """A bad id is named wherever it sits in a long prompt (bools are ints to Python, not token ids); a prompt of
    good ids passes."""
    from hybridkv.sidecar.core.sampling import validate_request

    params = SamplingParams(max_tokens=1)
    good = list(range(500)) * 6
    validate_request("ok", good, params, max_model_len=4096, vocab_size=512)
    for index in (0, 1500, len(good) - 1):
        prompt = good[:index] + [bad] + good[index + 1:]
        with pytest.raises(RequestError, match=f"prompt token id {bad!r} is outside the vocabulary"):
            validate_request("bad", prompt, params, max_model_len=4096, vocab_size=512)


def run_arriving(engine: Engine, prompts: list[list[int]], params: SamplingParams, every: int) -> dict:
    """Add one prompt every `every` steps while the earlier ones decode; each request's tokens, by id."""
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % every == 0:
            index, prompt = pending.pop(0)
            engine.add_request(f"r{index}", prompt, params)
            tokens[f"r{index}"] = []
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        engine.check_invariants()
        steps += 1
    return tokens


def test_a_tpot_target_holds_prompts_back_and_changes_no_token(tiny_checkpoint):
    prompts = prompts_of_lengths([9, 5, 30, 3, 17, 6], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = make_engine(tiny_checkpoint, min_prefill_tokens_with_decodes=0)
    held = make_engine(tiny_checkpoint, min_prefill_tokens_with_decodes=0, target_tpot_ms=10.0)
    now = [0.0]

    def clock() -> float:  # the scheduler's clock: a step with prefill takes 50 ms, a pure decode step 1 ms
        last = held.scheduler._last_step
        now[0] += 0.001 if last is None or last[1] else 0.050
        return now[0]

    held.scheduler.clock = clock
    try:
        expected = run_arriving(plain, prompts, params, every=2)
        assert run_arriving(held, prompts, params, every=2) == expected
        assert plain.stats().tpot_held_steps_total == 0 and held.stats().tpot_held_steps_total > 0
        assert held.model_info()["target_tpot_ms"] == 10.0 and plain.model_info()["target_tpot_ms"] is None
    finally:
        plain.close()
        held.close()


def test_holding_prefill_while_decodes_run_changes_no_token(tiny_checkpoint):
    prompts = prompts_of_lengths([9, 5, 30, 3, 17, 6], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = make_engine(tiny_checkpoint, min_prefill_tokens_with_decodes=0)
    held = make_engine(tiny_checkpoint, min_prefill_tokens_with_decodes=24, max_prefill_wait_steps=3)
    try:
        expected = run_arriving(plain, prompts, params, every=2)
        assert run_arriving(held, prompts, params, every=2) == expected
        assert plain.stats().prefill_held_steps_total == 0
        # Short prompts arriving beside decodes waited; each wait ended by the wait steps or the minimum.
        assert held.stats().prefill_held_steps_total > 0
        assert held.stats().steps_by_kind_total["mixed"] < plain.stats().steps_by_kind_total["mixed"]
        assert held.model_info()["min_prefill_tokens_with_decodes"] == 24
    finally:
        plain.close()
        held.close()


def test_prefill_is_held_by_default_only_where_decode_steps_replay_cuda_graphs(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)  # CPU: every step runs eagerly
    try:
        assert engine.scheduler.min_prefill_tokens_with_decodes == 0
    finally:
        engine.close()


@pytest.mark.parametrize("prefix_caching, batched, expected", [(False, 8192, 4096), (True, 8192, 1024),
                                                                (False, 2048, 2048), (True, 512, 512)])
def test_the_default_hold_where_decode_steps_replay_graphs(tiny_checkpoint, prefix_caching, batched, expected):
    """With decode graphs the hold defaults to 4096 ready tokens, 1024 with prefix caching on (a cached prompt has
    little left to prefill), never more than one mixed step may take; an explicit value always wins."""
    engine = make_engine(tiny_checkpoint, enable_prefix_caching=prefix_caching, max_num_batched_tokens=batched)
    try:
        engine.runner.graphs = {1: "a captured decode graph"}  # what a GPU start-up leaves; CPU captures none
        assert engine._min_prefill_tokens_with_decodes() == expected
        engine.config.min_prefill_tokens_with_decodes = 7
        assert engine._min_prefill_tokens_with_decodes() == 7
    finally:
        engine.runner.graphs = {}
        engine.close()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"prefix_checkpoint_slots": 4}, "--prefix-checkpoint-slots needs prefix caching on"),
        ({"enable_prefix_caching": True, "prefix_checkpoint_slots": 0}, "prefix_checkpoint_slots must be"),
        ({"enable_prefix_caching": True, "prefix_checkpoint_interval": 24}, "multiple of block_size"),
        ({"kv_offload": True}, "KV offload is not supported by the dual-pool cache yet"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens"),
        ({"block_size": 12}, "power of two"),
        ({"min_prefill_tokens_with_decodes": 10**6}, "min_prefill_tokens_with_decodes must be"),
        ({"max_prefill_wait_steps": -1}, "max_prefill_wait_steps must be"),
        ({"target_tpot_ms": 0.0}, "target_tpot_ms must be a number of milliseconds"),
        ({"target_tpot_ms": float("nan")}, "target_tpot_ms must be"),
        ({"target_tpot_ms": True}, "target_tpot_ms must be"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": 10**6}, "max_position_embeddings"),
    ],
)
def test_unsupported_or_invalid_settings_fail_at_start(tiny_checkpoint, overrides, message):
    with pytest.raises(UserError, match=message):
        make_engine(tiny_checkpoint, **overrides)


def test_max_model_len_beyond_the_token_pool_fails_at_start(tiny_checkpoint):
    budget = pool_budget(tiny_checkpoint, state_slots=2, token_blocks=4, block_size=16)
    with pytest.raises(UserError, match="max_model_len=128 needs 128 tokens but the token pool holds 64"):
        make_engine(tiny_checkpoint, max_num_seqs=2, kv_cache_memory_bytes=budget, max_model_len=128)


def test_sampler_top_k_top_p_and_distribution():
    sampler = Sampler(torch.device("cpu"), seed=7)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(4000, 1)
    top2 = sampler(logits, [sampler.new_state(SamplingParams(top_k=2))] * 4000)
    assert set(top2) == {0, 1}
    probs = torch.softmax(logits[0], dim=0)
    # top_p 0.7: the nucleus is the two most likely tokens (0.61 < 0.7 <= 0.84).
    nucleus = sampler(logits, [sampler.new_state(SamplingParams(top_p=0.7))] * 4000)
    assert set(nucleus) == {0, 1}
    plain = torch.bincount(torch.tensor(sampler(logits, [sampler.new_state(SamplingParams())] * 4000)),
                           minlength=5).float() / 4000
    assert torch.allclose(plain, probs, atol=0.03)
    greedy = sampler(logits[:3], [sampler.new_state(SamplingParams(temperature=0.0))] * 3)
    assert greedy == [0, 0, 0]


class EngineMachine(RuleBasedStateMachine):
    """Random add / step / abort against a small engine; the pools' invariants hold after every rule."""

    folder: str = ""

    @initialize(block_size=st.sampled_from([2, 4, 8]), token_blocks=st.integers(12, 40))
    def setup(self, block_size, token_blocks):
        budget = pool_budget(self.folder, 3, token_blocks, block_size)
        self.engine = make_engine(self.folder, max_num_seqs=3, max_num_batched_tokens=12, block_size=block_size,
                                  kv_cache_memory_bytes=budget, max_model_len=token_blocks * block_size)
        self.max_model_len = token_blocks * block_size
        self.next_id = 0
        self.live: set[str] = set()

    @rule(prompt_len=st.integers(1, 24), max_tokens=st.integers(1, 6), greedy=st.booleans())
    def add(self, prompt_len, max_tokens, greedy):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        prompt_len = min(prompt_len, self.max_model_len - max_tokens)
        params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(request_id, [7 + i for i in range(prompt_len)], params)
        self.live.add(request_id)

    @rule()
    def step(self):
        for output in self.engine.step():
            if output.finished:
                self.live.discard(output.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort(request_id)
        outputs = self.engine.step()  # the abort takes effect at the start of the next step
        assert any(o.request_id == request_id and o.finish_reason in ("abort", "stop", "length") for o in outputs)
        for output in outputs:
            if output.finished:
                self.live.discard(output.request_id)

    @invariant()
    def pools_consistent(self):
        self.engine.check_invariants()
        stats = self.engine.stats()
        assert stats.running <= 3 and stats.used_state_slots == stats.running


@pytest.fixture
def engine_machine(tiny_checkpoint):
    EngineMachine.folder = tiny_checkpoint
    return EngineMachine


def test_engine_pool_invariants_under_random_requests(engine_machine):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(engine_machine, settings=settings(max_examples=25, stateful_step_count=25))


def test_the_batch_context_says_whether_a_prefill_chunk_runs_on_the_null_slot(tiny_checkpoint, seed):
    """A mixed step of served requests has no prefill chunk on the null slot, so the GDN prefill is told it has no
    rows to zero; a batch with one there (as the start-up profiling pass runs) says so. The prefill chunks' offsets
    and slots, derived once per step for every GDN layer, are the step's own counted from its first prefill token."""
    engine = make_engine(tiny_checkpoint)
    first, second = prompts_of_lengths([5, 12], seed)
    runner = engine.runner
    execute, batches = runner.execute, []
    runner.execute = lambda batch, *args: batches.append(batch) or execute(batch, *args)
    engine.add_request("r0", first, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    engine.add_request("r1", second, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # r0 decodes beside r1's prompt
    del runner.execute
    batch = batches[-1]
    ctx = runner._prepare(batch)[2]
    assert ctx.num_decodes == 1 and ctx.num_seqs == 2 and ctx.prefill_on_null_slot is False
    assert ctx.prefill_cu_seqlens_cpu == [0, len(second)]
    assert ctx.prefill_cu_seqlens.tolist() == ctx.prefill_cu_seqlens_cpu
    slots = ctx.state_slot_ids.tolist()
    assert ctx.prefill_slot_ids.tolist() == slots[1:] and ctx.decode_slot_ids.tolist() == slots[:1]
    on_null = replace(batch, state_slots=batch.state_slots[:1] + [0])
    assert engine.runner._prepare(on_null)[2].prefill_on_null_slot is True


def test_padding_rows_on_the_null_slot_and_block_leave_real_rows_alone(tiny_checkpoint, seed):
    """What CUDA-graph padding relies on, checked on the CPU path: extra decode rows with state slot 0 and block 0
    change neither the real rows' logits nor any state (the null slot stays zero)."""
    engine = make_engine(tiny_checkpoint)
    for index, prompt in enumerate(prompts_of_lengths([5, 12], seed)):
        engine.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # prefill; both requests now decode
    batch = StepBatch.from_chunks(engine.scheduler.schedule())
    assert batch.num_decodes == batch.num_seqs == 2
    pools = [t for pair in engine.cache.kv_caches + engine.cache.state_caches for t in pair]
    saved = [t.clone() for t in pools]
    plain = engine.runner.execute(batch)
    plain_states = [t.clone() for pair in engine.cache.state_caches for t in pair]
    for tensor, copy in zip(pools, saved):
        tensor.copy_(copy)
    padding = 3
    padded = replace(
        batch, num_decodes=batch.num_decodes + padding, input_ids=batch.input_ids + [0] * padding,
        positions=batch.positions + [0] * padding, query_lens=batch.query_lens + [1] * padding,
        seq_lens=batch.seq_lens + [1] * padding, block_tables=batch.block_tables + [[0]] * padding,
        state_slots=batch.state_slots + [0] * padding,
    )
    # Only float32 summation order may differ (a 5-row matmul instead of a 2-row one).
    torch.testing.assert_close(engine.runner.execute(padded), plain, atol=1e-4, rtol=0)
    for state, expected in zip([t for pair in engine.cache.state_caches for t in pair], plain_states):
        assert state[0].abs().sum() == 0
        torch.testing.assert_close(state, expected, atol=1e-5, rtol=0)



def test_final_outputs_say_where_each_request_spent_its_time(tiny_checkpoint, seed):
    """With one state slot the second request waits in the queue while the first runs: its queue time covers the
    first one's whole time in the engine. Only a request's final output carries its timings."""
    engine = make_engine(tiny_checkpoint, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for index, prompt in enumerate(prompts_of_lengths([9, 7], seed)):
        engine.add_request(f"r{index}", prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.timings
            else:
                assert output.timings is None
    first, second = finals["r0"], finals["r1"]
    for timings in (first, second):
        assert timings.queue_s >= 0 and timings.prefill_s > 0 and timings.decode_s > 0
        assert timings.inference_s == timings.prefill_s + timings.decode_s
    # Both arrived together (two add_request calls apart); the second was admitted after the first finished.
    assert second.queue_s >= first.queue_s + first.inference_s - 0.01
    assert first.queue_s < first.inference_s


def test_a_request_aborted_before_its_first_token_reports_no_timings(tiny_checkpoint, seed):
    engine = make_engine(tiny_checkpoint, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for index, prompt in enumerate(prompts_of_lengths([9, 7], seed)):
        engine.add_request(f"r{index}", prompt, params)
    engine.abort("r1")  # still waiting
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({output.request_id: output for output in engine.step() if output.finished})
    assert finals["r1"].finish_reason == "abort" and finals["r1"].timings is None
    assert finals["r0"].timings is not None


@pytest.mark.gpu
def test_greedy_tokens_equal_transformers_on_gpu_at_qwen35_4b_geometry(seed):
    """The Qwen3.5-4B geometry's random bf16 checkpoint, both sides computing in float32 (see GPU_LOGITS_ATOL): at
    every step the engine's logits equal transformers' fed the same tokens within the bound above, and free-running
    greedy tokens agree up to the first step where transformers' two best logits are within NEAR_TIE_LOGITS."""
    import gc

    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # The same folder bench/throughput.py uses: an 8 GB checkpoint is written once per machine.
    folder = os.path.join(tempfile.gettempdir(), "hybridkv-qwen3.5-4b-bf16")
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):  # written last by make_model
        make_model(folder, catalog_geometry("qwen3.5-4b"), seed=0, dtype="bfloat16")
    engine = Engine(EngineConfig(model=folder, device="cuda", dtype="float32", max_num_seqs=16, max_model_len=1024,
                                 gpu_memory_utilization=0.6))
    prompts = prompts_of_lengths([1, 17, 100, 300], seed, vocab=engine.geometry.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    all_tokens, all_logits = generate_recording_logits(engine, prompts, params)
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    hf = load_hf_model(folder, dtype=torch.float32, device="cuda")
    for index, (prompt, tokens, logits) in enumerate(zip(prompts, all_tokens, all_logits)):
        forced = torch.tensor([prompt + tokens[:-1]], device="cuda")
        with torch.inference_mode():
            expected, spread = tf32_spread(lambda: hf(forced).logits[0, len(prompt) - 1:].float().cpu())
        atol = max(GPU_LOGITS_ATOL, TF32_SPREADS * spread)
        print(f"prompt {index}: max |logit difference| {(logits - expected).abs().max().item():.3g}, "
              f"transformers' own TF32 spread {spread:.3g}")
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0, msg=lambda m: f"prompt {index}: {m}")
    assert_greedy_matches_up_to_near_ties(hf, prompts, all_tokens)


def assert_greedy_matches_up_to_near_ties(hf, prompts, token_lists, min_matched: int = 16) -> None:
    """Tokens equal transformers' greedy tokens; a divergence may only happen where transformers' two best logits
    are within NEAR_TIE_LOGITS, and the engine's token there must be one of those two."""
    matched = 0
    for index, (prompt, tokens) in enumerate(zip(prompts, token_lists)):
        expected, logits = hf_greedy(hf, prompt, len(tokens))
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if diverged is not None:
            top2 = logits[diverged].topk(2)
            assert float(top2.values[0] - top2.values[1]) < NEAR_TIE_LOGITS, f"prompt {index} diverged at {diverged}"
            assert tokens[diverged] in top2.indices.tolist()
        matched += len(expected) if diverged is None else diverged
    assert matched >= min_matched, "too few tokens compared to mean anything"


@pytest.mark.gpu
def test_cuda_graph_decode_on_triton_kernels_matches_transformers(tiny_checkpoint, hf_model, seed):
    """Five requests decode in the 8-row graph (three padding rows on the null slot and block); float32 on the
    Triton kernels, against transformers in float32 on CPU, tokens equal up to near-ties (see GPU_LOGITS_ATOL)."""
    prompts = prompts_of_lengths([3, 30, 9, 17, 1], seed)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for enforce_eager in (False, True):
        engine = make_engine(tiny_checkpoint, device="cuda", enforce_eager=enforce_eager)
        assert (8 in engine.runner.graphs) != enforce_eager
        completions = run_checked(engine, prompts, params)
        assert_greedy_matches_up_to_near_ties(hf_model, prompts, [c.token_ids for c in completions])


@pytest.mark.gpu
def test_decode_graphs_give_the_same_tokens_with_early_releases_and_in_plain_order(tmp_path, monkeypatch, seed):
    """The 0.8B's decode steps replayed from CUDA graphs, where each kernel of the chain lets the next one start
    before it waits (`HYBRIDKV_EARLY_RELEASE`, the default), where each lets it start after its wait, and launched in
    plain order: the same greedy tokens and log-probabilities, to the bit, alone (the GEMV path) and five at once."""
    from hybridkv.kernels import triton_utils
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    folder = make_model(tmp_path, catalog_geometry("qwen3.5-0.8b"), 0, dtype="bfloat16", weights=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    results = {}
    for early, dependent in (("on", "on"), ("off", "on"), ("off", "off")):
        monkeypatch.setenv("HYBRIDKV_EARLY_RELEASE", early)
        monkeypatch.setenv("HYBRIDKV_DEPENDENT_LAUNCH", dependent)
        triton_utils.early_release_mode.cache_clear()
        triton_utils.dependent_launch_mode.cache_clear()
        engine = make_engine(str(folder), device="cuda", dtype="auto", load_format="random", enforce_eager=False,
                             kv_cache_memory_bytes=1 << 30, max_num_seqs=8, max_model_len=2048)
        try:
            assert triton_utils.early_release(torch.device("cuda")) == (early == "on")
            runs = [engine.generate(prompts, params) for prompts in (prompts_of_lengths([40], seed, 240000),
                                                                     prompts_of_lengths([3, 300, 9, 70, 1], seed,
                                                                                        240000))]
        finally:
            engine.close()
        results[early, dependent] = [(c.token_ids, [(e.logprob, e.top) for e in c.logprobs])
                                     for completions in runs for c in completions]
    triton_utils.early_release_mode.cache_clear()
    triton_utils.dependent_launch_mode.cache_clear()
    assert results["on", "on"] == results["off", "on"] == results["off", "off"]


# Sampled rows take the sampler's other paths (temperature, top-p, a seeded generator, penalties, logprobs), whose
# per-row values go to the device as well.
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.1, logprobs=2, max_tokens=24,
                         ignore_eos=True)


def launch_checked_for_syncs(engine, steps: int, expect_decodes_only: bool) -> list:
    """Run `steps` engine steps with CUDA's sync debug mode raising on any host wait inside a step's launch."""
    launch, launched = engine._launch, []

    def checked_launch(chunks):
        assert all(chunk.num_tokens == 1 for chunk in chunks) == expect_decodes_only
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched.append(launch(chunks))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return launched[-1]

    engine._launch = checked_launch
    try:
        outputs = [output for _ in range(steps) for output in engine.step()]
    finally:
        del engine._launch
    assert len(launched) == steps
    return outputs


@pytest.mark.gpu
@pytest.mark.parametrize("prefix_caching, params", [
    (False, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
    (True, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
    (False, SAMPLED),
], ids=["plain", "prefix-caching", "sampled"])
def test_gpu_decode_steps_launch_without_waiting_for_the_device(tiny_checkpoint, seed, prefix_caching, params):
    """Once every request decodes, launching a step (graph replay, logits, sampling, the copy of the ids to the host)
    never synchronizes with the device, so the host work of the step before overlaps with it. With prefix caching,
    decodes that cross a block boundary also save their state to a checkpoint (two of them in these steps)."""
    engine = make_engine(tiny_checkpoint, device="cuda", enforce_eager=False, enable_prefix_caching=prefix_caching)
    for index, prompt in enumerate(prompts_of_lengths([3, 30, 9], seed)):
        engine.add_request(f"s{index}", prompt, params)
    for _ in range(3):  # the prefill (fla's varlen kernels read chunk offsets on the host) and the first decode
        engine.step()
    outputs = launch_checked_for_syncs(engine, 8, expect_decodes_only=True)
    assert len(outputs) == 3 * 8 and all(len(output.new_token_ids) == 1 for output in outputs)


@pytest.mark.gpu
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), SAMPLED],
                         ids=["greedy", "sampled"])
def test_gpu_mixed_steps_launch_without_waiting_for_the_device(tiny_checkpoint, seed, params):
    """A prompt admitted beside decoding requests runs a mixed step, eagerly: its launch (the forward, the gather of
    the sampled rows, sampling) waits for the device nowhere either, so a mixed step's host work overlaps the step
    before it."""
    engine = make_engine(tiny_checkpoint, device="cuda", enforce_eager=False, min_prefill_tokens_with_decodes=0)
    for index, prompt in enumerate(prompts_of_lengths([3, 30], seed)):
        engine.add_request(f"s{index}", prompt, params)
    for _ in range(3):
        engine.step()
    engine.add_request("late", prompts_of_lengths([40], seed + 1)[0], params)
    launch_checked_for_syncs(engine, 1, expect_decodes_only=False)
    assert engine.steps_by_kind["mixed"] >= 1



@pytest.mark.gpu
def test_gpu_a_step_with_prefill_reads_the_finished_step_before_it_first(tiny_checkpoint, seed):
    """When the device has finished the launched step by the time a step with prefill is scheduled, its ids are read
    before that step launches: the mixed step's decode rows carry their known ids, none waits on the device for
    one. While the device still runs it (a decode step right after a launch), the overlap order stays."""
    engine = make_engine(tiny_checkpoint, device="cuda", enforce_eager=False, min_prefill_tokens_with_decodes=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for index, prompt in enumerate(prompts_of_lengths([3, 30], seed)):
        engine.add_request(f"s{index}", prompt, params)
    for _ in range(3):
        engine.step()
    pending_rows = []
    execute = engine.runner.execute

    def counting_execute(batch, *args):
        pending_rows.append(sum(token == PENDING_TOKEN for token in batch.input_ids[:batch.num_decodes]))
        return execute(batch, *args)

    engine.runner.execute = counting_execute
    engine.step()  # a decode step, launched right after the one before it: its rows read their ids on the device
    torch.cuda.synchronize()
    engine.add_request("late", prompts_of_lengths([40], seed + 1)[0], params)
    engine.step()  # the device is idle: the decode step's ids are read before the mixed step launches
    assert engine.steps_by_kind["mixed"] == 1
    assert pending_rows == [2, 0]


def test_steps_are_counted_by_kind_with_their_time_and_reach_the_metrics(tiny_checkpoint, seed):
    """A prompt alone is a prefill step, a prompt admitted beside decoding requests a mixed step, decodes alone a
    decode step; the loop's seconds and its device wait (none on CPU, where results are ready) go with them."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from hybridkv.sidecar.serving.metrics import ServingMetrics

    engine = make_engine(tiny_checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompts_of_lengths([9], seed)[0], params)
    engine.step()  # a's prompt: prefill
    engine.step()  # a decodes: decode
    engine.add_request("b", prompts_of_lengths([7], seed + 1)[0], params)
    engine.step()  # b's prompt beside a's decode: mixed
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    steps = stats.steps_by_kind_total
    # a: prefill, decode, then beside b's prompt (mixed), decode; b then decodes its last three tokens alone.
    assert steps == {"decode": 4, "mixed": 1, "prefill": 1}
    assert stats.step_seconds_total > 0 and stats.device_wait_seconds_total == 0.0

    frontend = SimpleNamespace(token_listeners=[], finish_listeners=[], timing_listeners=[], stats=stats)
    text = generate_latest(ServingMetrics(frontend, "tiny").registry).decode()
    assert f'hybridkv:engine_steps_total{{kind="mixed"}} 1.0' in text
    assert f'hybridkv:engine_steps_total{{kind="decode"}} {float(steps["decode"])}' in text
    assert "hybridkv:engine_step_seconds_total" in text and "hybridkv:engine_device_wait_seconds_total 0.0" in text
