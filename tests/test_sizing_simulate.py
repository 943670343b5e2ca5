"""Workload replay: traces, the seeded generator, admission, preemption and refusal per allocator."""

from __future__ import annotations

import pytest

from hybridkv.sizing import (
    DUAL_POOL,
    VLLM_0_20_NONE,
    WorkloadError,
    byte_model,
    catalog_geometry,
    pool_model,
    pool_models,
)
from hybridkv.sizing.simulate import TraceRequest, parse_trace, read_trace, replay, synthetic_workload, write_trace

RANK = byte_model(catalog_geometry("qwen3.5-0.8b"))
BLOCK_BYTES = 16 * RANK.bytes_per_token

HOPPER = (9, 0)  # H100/H200: vLLM 0.33 runs FlashInfer's GDN prefill


def _dual_pool(usable_blocks: int, max_num_seqs: int):
    budget = (max_num_seqs + 1) * RANK.bytes_per_request + (usable_blocks + 1) * BLOCK_BYTES
    return pool_model(DUAL_POOL, RANK, budget, max_num_seqs)


def test_generator_is_reproducible_and_bounded(seed):
    first = synthetic_workload(seed, 300, 4096, arrivals_per_step=2.0, mean_prompt_tokens=512, mean_output_tokens=128)
    assert first == synthetic_workload(seed, 300, 4096, 2.0, 512, 128)
    assert first != synthetic_workload(seed + 1, 300, 4096, 2.0, 512, 128)
    assert all(r.total_tokens <= 4096 and r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in first)
    arrivals = [r.arrival_step for r in first]
    assert arrivals == sorted(arrivals)
    # 300 Poisson arrivals at 2 per step span about 150 steps
    assert 100 < arrivals[-1] < 200


def test_trace_round_trip(tmp_path, seed):
    requests = synthetic_workload(seed, 50, 2048)
    path = tmp_path / "trace.jsonl"
    write_trace(requests, path)
    assert read_trace(path) == requests


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"arrival_step": 0, "prompt_tokens": 5}\n', "line 1: output_tokens must be an integer"),
        ('{"arrival_step": 0, "prompt_tokens": 5, "output_tokens": 1}\nnot json\n', "line 2 is not JSON"),
        ('{"arrival_step": -1, "prompt_tokens": 5, "output_tokens": 1}\n', "arrival_step must be"),
        ('{"arrival_step": 0, "prompt_tokens": 5, "output_tokens": 1, "priority": 2}\n', "unknown key"),
        ("\n", "holds no requests"),
        ("[" * 50_000 + "]" * 50_000 + "\n", "line 1 nests its JSON too deeply"),
        ('{"arrival_step": ' + "9" * 5000 + "}\n", "line 1 is not JSON hybridkv can read"),
    ],
)
def test_bad_trace_lines_are_named(text, message):
    with pytest.raises(WorkloadError, match=message):
        parse_trace(text.splitlines(), "t.jsonl")


def test_admission_waits_for_blocks_and_slots():
    """10 usable 16-token blocks, 4 slots; each request holds ceil(41/16) = 3 blocks after its prefill step, so three
    run at once and the fourth waits until one finishes (after its 2nd output token)."""
    pool = _dual_pool(10, 4)
    requests = [TraceRequest(0, 40, 2) for _ in range(4)]
    result = replay(pool, requests, 4096, check_invariants=True)
    assert result.peak_concurrency == 3
    assert result.completed == 4 and result.refused == 0 and result.preemptions == 0
    # step 0: three prefills; step 1: they decode their 2nd token and finish; step 2: the fourth prefills, step 3 ends
    assert result.steps == 4


def test_slots_cap_concurrency_even_with_free_blocks():
    result = replay(_dual_pool(1000, 2), [TraceRequest(0, 10, 5) for _ in range(6)], 4096, check_invariants=True)
    assert result.peak_concurrency == 2 and result.completed == 6


def test_growth_past_the_pool_preempts_the_newest_request():
    """Two requests each growing to 64 tokens (4 blocks) in a 6-block pool: the newer one is preempted, recomputed
    after the older finishes, and both complete."""
    result = replay(_dual_pool(6, 2), [TraceRequest(0, 16, 48), TraceRequest(0, 16, 48)], 4096, check_invariants=True)
    assert result.preemptions >= 1 and result.completed == 2


def test_requests_that_can_never_fit_are_refused():
    pool = _dual_pool(4, 2)  # 64 tokens
    requests = [TraceRequest(0, 100, 10), TraceRequest(0, 4000, 200), TraceRequest(1, 10, 10)]
    result = replay(pool, requests, 4096)
    assert (result.refused, result.completed) == (2, 1)


@pytest.mark.parametrize("max_num_seqs", [8, 64])
def test_every_allocator_keeps_its_books_on_a_random_workload(seed, max_num_seqs):
    requests = synthetic_workload(seed, 200, 2048, arrivals_per_step=6.0, mean_prompt_tokens=400,
                                  mean_output_tokens=60)
    budget = 64 * RANK.bytes_per_request + 4000 * BLOCK_BYTES
    for pool in pool_models(RANK, budget, max_num_seqs, compute_capability=HOPPER).values():
        result = replay(pool, requests, 2048, check_invariants=True)
        assert result.completed + result.refused == 200
        assert result.peak_concurrency <= max_num_seqs
        assert result.invariant_checks > 0


def test_small_blocks_run_more_requests_at_once():
    """200 requests growing to 600 tokens, on a budget sized for exactly 200 of them in the dual pool (200 slots and
    38 16-token blocks each). vLLM's 544-token blocks need 2 + 3 state blocks per request (~33 MB against ~27 MB)."""
    budget = 201 * RANK.bytes_per_request + (200 * 38 + 1) * BLOCK_BYTES
    requests = [TraceRequest(0, 590, 10) for _ in range(200)]
    ours = replay(pool_model(DUAL_POOL, RANK, budget, 200), requests, 4096, check_invariants=True)
    vllm_pool = pool_model(VLLM_0_20_NONE, RANK, budget, 200)
    vllm = replay(vllm_pool, requests, 4096, check_invariants=True)
    assert ours.peak_concurrency == 200 and ours.preemptions == 0
    assert vllm.peak_concurrency == vllm_pool.pool_units // (3 + 2) < 200
    assert ours.steps < vllm.steps


def test_a_trace_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(WorkloadError, match="is not UTF-8 text"):
        read_trace(path)
