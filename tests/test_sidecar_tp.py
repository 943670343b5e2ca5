"""Tensor parallelism on CPU over gloo, in float32: tp=2 and tp=4 engines against the single-rank engine.

The tiny checkpoint has 4 query heads, 2 KV heads, 4 GDN key heads and 8 GDN value heads: tp=2 splits every head
group, tp=4 also replicates the KV heads (one per rank). Each engine gets the per-rank cache budget that holds exactly
the same token blocks and state slots, so all of them schedule the same steps: prompts longer than a step are
prefilled in chunks and too few blocks force preemptions. Steps overlap on every engine: decode rows carry
PENDING_TOKEN, which the workers fill from the ids rank 0 broadcasts. Greedy tokens must be identical; logits agree to
`LOGITS_ATOL` = 1e-3 absolute (the tiny model's logits have a standard deviation of about 8), the residual being the
order of float32 sums in the all-reduces.

One engine per tp value is shared by the module (spawning ranks and importing torch in them is slow). A process
belongs to one process group at a time, so the worker-crash tests live in `test_sidecar_tp_failures.py`.
"""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch
from engine_fixtures import make_engine, tiny_checkpoint  # noqa: F401 - pytest fixture

from hybridkv.errors import UserError
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.execution.runner import PENDING_TOKEN

LOGITS_ATOL = 1e-3
BLOCK_SIZE = 16
TOKEN_BLOCKS = 8  # 128 tokens for prompts and outputs needing about 200 at once: preemption
STATE_SLOTS = 4
MAX_NUM_BATCHED_TOKENS = 32  # below the longest prompt: chunked prefill
PROMPT_LENGTHS = (5, 40, 90, 23)
MAX_TOKENS = 10


def rank_budget_bytes(folder: str, tp: int) -> int:
    """The per-rank cache budget holding exactly TOKEN_BLOCKS blocks and STATE_SLOTS slots (plus the null block and
    slot) in float32, from config.json: KV heads split across ranks or replicated one per rank, GDN heads split."""
    config = json.load(open(os.path.join(folder, "config.json")))
    layer_types = config["layer_types"]
    kv_heads = max(1, config["num_key_value_heads"] // tp)
    bytes_per_token = layer_types.count("full_attention") * 2 * kv_heads * config["head_dim"] * 4
    conv_dim = (2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
                + config["linear_num_value_heads"] * config["linear_value_head_dim"]) // tp
    conv_bytes = (config["linear_conv_kernel_dim"] - 1) * conv_dim * 4
    ssm_bytes = (config["linear_num_value_heads"] // tp) * config["linear_value_head_dim"] * config[
        "linear_key_head_dim"] * 4
    bytes_per_request = layer_types.count("linear_attention") * (conv_bytes + ssm_bytes)
    return (STATE_SLOTS + 1) * bytes_per_request + (TOKEN_BLOCKS + 1) * BLOCK_SIZE * bytes_per_token


def start_engine(folder: str, tp: int, **overrides):
    return make_engine(folder, tensor_parallel_size=tp, max_num_seqs=STATE_SLOTS, block_size=BLOCK_SIZE,
                       max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=TOKEN_BLOCKS * BLOCK_SIZE,
                       kv_cache_memory_bytes=rank_budget_bytes(folder, tp), **overrides)


def scenario_prompts() -> list[list[int]]:
    return [[(37 * index + 11 * position) % 500 for position in range(length)]
            for index, length in enumerate(PROMPT_LENGTHS)]


class Recording:
    """Every step's logits and how many of its input ids were pending (sampled on the device, not yet read)."""

    def __init__(self, engine):
        self.engine = engine
        self.step_logits: list[torch.Tensor] = []
        self.pending_rows = 0

    def __enter__(self) -> "Recording":
        execute = self.engine.runner.execute

        def recording_execute(batch, *args):
            self.pending_rows += sum(token == PENDING_TOKEN for token in batch.input_ids)
            logits = execute(batch, *args)
            self.step_logits.append(logits.clone())
            return logits

        self.engine.runner.execute = recording_execute
        return self

    def __exit__(self, *exc_info) -> None:
        del self.engine.runner.execute


def run_scenario(engine) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy generation of all prompts at once; returns the tokens, every step's logits and the preemptions. The
    pools' invariants (on every rank) are checked after every step, and with overlapped steps some decode rows must
    have been pending."""
    preemptions_before = engine.stats().preemptions_total
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = scenario_prompts()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    tokens = {f"r{index}": [] for index in range(len(prompts))}
    with Recording(engine) as recording:
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id].extend(output.new_token_ids)
            engine.check_invariants()
    assert (recording.pending_rows > 0) == engine.overlap_steps
    return list(tokens.values()), recording.step_logits, engine.stats().preemptions_total - preemptions_before


def run_stops_and_aborts(engine, stop_token: int) -> tuple[dict[str, tuple], int]:
    """Requests that end while the next step is already on the device: by a stop id, by length (after 1 token and
    after MAX_TOKENS), and by aborts sent after a fixed number of steps (s1 mid-decode, s5 mid-prefill, after s4 was
    preempted twice). Returns each request's streamed tokens, finish reason and completion tokens, and the
    preemptions; the invariants of every rank are checked after every step."""
    prompts = scenario_prompts()
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    ]
    prompts += [prompts[1][:33], prompts[2][:70]]
    aborts = {4: "s1", 18: "s5"}
    streams = {f"s{index}": [[], None, None] for index in range(len(prompts))}
    preemptions_before = engine.stats().preemptions_total
    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{index}", prompt, request_params)
    step = 0
    with Recording(engine) as recording:
        while engine.has_unfinished_requests():
            for output in engine.step():
                stream = streams[output.request_id]
                stream[0] += output.new_token_ids
                if output.finished:
                    stream[1:] = [output.finish_reason, output.completion_tokens]
            engine.check_invariants()
            step += 1
            if step in aborts:
                assert engine.abort(aborts[step])
    assert recording.pending_rows > 0, "steps did not overlap"
    outputs = {request_id: (tuple(tokens), reason, completion_tokens)
               for request_id, (tokens, reason, completion_tokens) in streams.items()}
    return outputs, engine.stats().preemptions_total - preemptions_before


@pytest.fixture(scope="module")
def single_rank_engine(tiny_checkpoint):  # noqa: F811
    return start_engine(tiny_checkpoint, 1)


@pytest.fixture(scope="module")
def single_rank_run(single_rank_engine):
    return run_scenario(single_rank_engine)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def tp_engine(request, tiny_checkpoint):  # noqa: F811
    engine = start_engine(tiny_checkpoint, request.param)
    workers = engine.executor.worker_processes
    yield engine
    engine.close()
    # A clean shutdown: every worker left by itself, and this process left the process group.
    assert [process.exitcode for process in workers] == [0] * (request.param - 1)
    assert not torch.distributed.is_initialized()


def test_tensor_parallel_greedy_tokens_and_logits_equal_the_single_rank_engine(tp_engine, single_rank_run):
    expected_tokens, expected_logits, expected_preemptions = single_rank_run
    assert expected_preemptions > 0, "the scenario must force preemption"
    tokens, logits, preemptions = run_scenario(tp_engine)
    assert tokens == expected_tokens
    assert all(len(completion) == MAX_TOKENS for completion in tokens)
    assert preemptions == expected_preemptions
    assert len(logits) == len(expected_logits)
    for step, (ours, reference) in enumerate(zip(logits, expected_logits)):
        assert ours.shape == reference.shape
        if not ours.numel():  # a step of prefill chunks that end mid-prompt samples nothing
            continue
        difference = (ours - reference).abs().max().item()
        assert difference <= LOGITS_ATOL, f"step {step}: max |logit difference| {difference:.2e} > {LOGITS_ATOL}"


def test_serial_steps_which_record_no_ids_give_the_same_tokens(tp_engine, single_rank_run):
    """Steps whose ids are never recorded (serial steps here, the warm-up elsewhere) leave the workers nothing to
    wait for."""
    tp_engine.overlap_steps = False
    try:
        tokens, _, preemptions = run_scenario(tp_engine)
    finally:
        tp_engine.overlap_steps = True
    assert (tokens, preemptions) == (single_rank_run[0], single_rank_run[2])


def test_stops_and_aborts_in_overlapped_steps_give_the_single_rank_outputs(tp_engine, single_rank_engine,
                                                                          single_rank_run):
    stop_token = single_rank_run[0][0][4]  # r0's fifth greedy token: s0 (the same prompt) stops there
    expected, expected_preemptions = run_stops_and_aborts(single_rank_engine, stop_token)
    # The scenario is what its docstring says: otherwise the comparison below would test less.
    assert expected["s0"] == (tuple(single_rank_run[0][0][:5]), "stop", 5)
    assert expected["s1"][1:] == ("abort", len(expected["s1"][0])) and 0 < len(expected["s1"][0]) < MAX_TOKENS
    assert [expected[f"s{index}"][1:] for index in (2, 3, 4)] == [("length", MAX_TOKENS), ("length", 1),
                                                                  ("length", MAX_TOKENS)]
    assert expected["s5"] == ((), "abort", 0) and expected_preemptions > 0
    assert run_stops_and_aborts(tp_engine, stop_token) == (expected, expected_preemptions)
    assert tp_engine.stats().used_state_slots == 0 and tp_engine.stats().used_token_blocks == 0


def test_capacity_is_measured_per_rank_next_to_the_planners_per_rank_prediction(tp_engine, single_rank_engine,
                                                                               tiny_checkpoint):  # noqa: F811
    tp = tp_engine.config.tensor_parallel_size
    report = tp_engine.capacity().to_dict()
    assert report["tensor_parallel_size"] == tp
    assert (report["token_blocks"], report["state_slots"]) == (TOKEN_BLOCKS, STATE_SLOTS)
    assert report["token_capacity"] == TOKEN_BLOCKS * BLOCK_SIZE
    assert report["budget_bytes"] == rank_budget_bytes(tiny_checkpoint, tp)
    assert report["token_pool_bytes"] + report["state_pool_bytes"] == rank_budget_bytes(tiny_checkpoint, tp)
    assert len(report["per_rank"]) == tp
    for rank in report["per_rank"]:
        assert {key: rank[key] for key in ("token_blocks", "state_slots", "token_pool_bytes", "state_pool_bytes")} \
            == {key: report[key] for key in ("token_blocks", "state_slots", "token_pool_bytes", "state_pool_bytes")}
        # Each rank holds its shard: about 1/tp of the model (norms and replicated KV heads are held whole).
        full_weights_bytes = single_rank_engine.capacity().weights_bytes
        assert full_weights_bytes / tp <= rank["weights_bytes"] < full_weights_bytes
    # Every rank holds its shard of both pools: the same blocks and slots, its share of the KV heads (one replicated
    # head each at tp=4), a null slot no kernel wrote.
    config = json.load(open(os.path.join(tiny_checkpoint, "config.json")))
    for pools in tp_engine.executor.pools():
        assert (pools.token_blocks, pools.state_slots) == (TOKEN_BLOCKS, STATE_SLOTS)
        assert pools.kv_heads == max(1, config["num_key_value_heads"] // tp)
        assert pools.null_slot_zero
    predicted = report["predicted"]
    assert (predicted["token_blocks"], predicted["state_slots"]) == (TOKEN_BLOCKS, STATE_SLOTS)
    assert predicted["token_pool_bytes"] == report["token_pool_bytes"]


def test_invalid_tensor_parallel_sizes_fail_before_any_worker_starts(tiny_checkpoint):  # noqa: F811
    from hybridkv.sidecar.execution.distributed import check_visible_devices

    children_before = set(multiprocessing.active_children())
    with pytest.raises(UserError, match="tensor_parallel_size=3: .*valid tp: 1, 2, 4"):
        make_engine(tiny_checkpoint, tensor_parallel_size=3)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="needs 2 GPUs .* 0 are visible"):
            check_visible_devices(torch.device("cuda"), 2)
    assert set(multiprocessing.active_children()) == children_before


def test_a_single_rank_engine_starts_no_worker_process(tiny_checkpoint):  # noqa: F811
    children_before = set(multiprocessing.active_children())
    engine = start_engine(tiny_checkpoint, 1)
    assert engine.executor is None
    assert set(multiprocessing.active_children()) == children_before
    assert len(engine.capacity().to_dict()["per_rank"]) == 1
