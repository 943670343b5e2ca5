"""Properties of the allocators, the prediction and the planner over random models, GPUs, budgets and targets."""

from __future__ import annotations

import re

from hypothesis import assume, given
from hypothesis import strategies as st

from hybridkv.sizing import (
    IDEAL,
    CapacityError,
    PlanError,
    byte_model,
    catalog_geometry,
    catalog_names,
    dual_pool_layout,
    gpu_catalog,
    parse_hybridmodel,
    pool_models,
    predict_capacity,
    valid_tensor_parallel_sizes,
)
from hybridkv.sizing.planner import MAX_PLANNED_UTILIZATION_PERCENT, plan
from hybridkv.sizing.simulate import TraceRequest, replay

GIB = 2**30
models = st.sampled_from(catalog_names())
gpus = st.sampled_from(gpu_catalog())

HOPPER = (9, 0)  # H100/H200: vLLM 0.33 runs FlashInfer's GDN prefill


@st.composite
def rank_bytes(draw):
    geometry = catalog_geometry(draw(models))
    tp = draw(st.sampled_from(valid_tensor_parallel_sizes(geometry, 8)))
    kv_dtype = draw(st.sampled_from(["bfloat16", "float8_e4m3fn"]))
    ssm_dtype = draw(st.sampled_from([None, "bfloat16", "float32"]))
    return byte_model(geometry, tp, kv_dtype=kv_dtype, ssm_dtype=ssm_dtype)


@given(rank=rank_bytes(), budget_gib=st.integers(1, 200), extra=st.integers(0, GIB), seqs=st.integers(1, 1024),
       running_fraction=st.floats(0, 1), request_tokens=st.integers(1, 300_000))
def test_no_allocator_beats_the_ideal_bound(rank, budget_gib, extra, seqs, running_fraction, request_tokens):
    budget = budget_gib * GIB + extra
    assume((seqs + 1) * rank.bytes_per_request + 2 * 16 * rank.bytes_per_token <= budget)
    pools = pool_models(rank, budget, seqs, compute_capability=HOPPER)
    ideal = pools[IDEAL.key]
    running = round(seqs * running_fraction)
    for pool in pools.values():
        assert pool.token_capacity(running) <= ideal.token_capacity(running)
        assert pool.max_concurrency(request_tokens) <= ideal.max_concurrency(request_tokens)
        assert sum(pool.breakdown(running).values()) == budget


@given(rank=rank_bytes(), budget_gib=st.integers(1, 100), more=st.integers(0, 50 * GIB), seqs=st.integers(1, 512),
       request_tokens=st.integers(1, 100_000))
def test_capacity_is_monotone_in_memory(rank, budget_gib, more, seqs, request_tokens):
    budget = budget_gib * GIB
    assume((seqs + 1) * rank.bytes_per_request + 2 * 16 * rank.bytes_per_token <= budget)
    small, large = pool_models(rank, budget, seqs, compute_capability=HOPPER), pool_models(rank, budget + more, seqs, compute_capability=HOPPER)
    for key in small:
        assert small[key].token_capacity(seqs) <= large[key].token_capacity(seqs)
        assert small[key].max_concurrency(request_tokens) <= large[key].max_concurrency(request_tokens)


@given(name=models, gpu=gpus, low=st.integers(1, 100), high=st.integers(1, 100), seqs=st.integers(1, 512))
def test_predicted_capacity_is_monotone_in_utilization(name, gpu, low, high, seqs):
    low, high = sorted((low, high))
    geometry = catalog_geometry(name)
    tp = valid_tensor_parallel_sizes(geometry, 8)[-1]

    def tokens(percent: int) -> int:
        try:
            return predict_capacity(geometry, tp, gpu.memory_bytes, f"{percent / 100:.2f}", seqs).layout.token_capacity
        except CapacityError:
            return 0

    assert tokens(low) <= tokens(high)


@given(rank=rank_bytes(), seqs=st.integers(1, 4096), blocks=st.integers(1, 10**6), slack=st.integers(0, 10**9),
       block_size=st.sampled_from([1, 16, 32, 528]))
def test_dual_pool_invariants(rank, seqs, blocks, slack, block_size):
    block_bytes = block_size * rank.bytes_per_token
    budget = (seqs + 1) * rank.bytes_per_request + (blocks + 1) * block_bytes + slack
    layout = dual_pool_layout(rank, budget, seqs, block_size)
    assert layout.state_slots == seqs  # the null slot is extra
    assert layout.state_pool_bytes == (seqs + 1) * rank.bytes_per_request
    assert layout.token_blocks >= blocks  # slack can only add blocks
    assert layout.token_capacity == layout.token_blocks * block_size
    assert layout.token_pool_bytes == (layout.token_blocks + 1) * block_bytes  # null block allocated, not counted
    assert layout.state_pool_bytes + layout.token_pool_bytes + layout.unused_bytes == budget
    assert 0 <= layout.unused_bytes < block_bytes


@given(name=models, gpu=gpus, max_model_len=st.integers(1, 262_144), concurrency=st.integers(1, 2048),
       target=st.one_of(st.none(), st.integers(1, 20_000_000)), max_gpus=st.one_of(st.none(), st.integers(1, 8)))
def test_planner_returns_a_valid_plan_that_meets_its_own_target_or_says_why(
    name, gpu, max_model_len, concurrency, target, max_gpus
):
    serving = {"maxModelLen": max_model_len, "maxConcurrency": concurrency}
    if target is not None:
        serving["targetTokens"] = target
    spec_gpu = {"product": gpu.product}
    if max_gpus is not None:
        spec_gpu["maxPerReplica"] = max_gpus
    spec = parse_hybridmodel({"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel", "metadata": {"name": "p"},
                              "spec": {"model": {"name": name, "source": {"uri": "hf://Qwen/x"}},
                                       "serving": serving, "gpu": spec_gpu}})
    try:
        result = plan(spec)
    except PlanError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    geometry = catalog_geometry(name)
    assert result.tensor_parallel_size in valid_tensor_parallel_sizes(geometry, max_gpus or 8)
    assert re.fullmatch(r"[01]\.\d\d", result.gpu_memory_utilization)
    assert 0 < int(result.gpu_memory_utilization.replace(".", "")) <= MAX_PLANNED_UTILIZATION_PERCENT
    assert result.max_num_seqs == concurrency == result.layout.state_slots
    assert result.token_capacity >= result.target_tokens >= max_model_len
    if target is not None:
        assert result.target_tokens >= target and result.requirement == "target"
    # The plan's own prediction, recomputed from its settings, is the one it reports.
    again = predict_capacity(geometry, result.tensor_parallel_size, result.gpu.memory_bytes,
                             result.gpu_memory_utilization, result.max_num_seqs,
                             checkpoint_slots=result.layout.checkpoint_slots)
    assert again.layout == result.layout


@given(rank=rank_bytes(), seqs=st.integers(1, 16), extra_blocks=st.integers(1, 400),
       shape=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 2000), st.integers(1, 300)), min_size=1,
                      max_size=40))
def test_replay_never_double_counts_or_leaks(rank, seqs, extra_blocks, shape):
    budget = (seqs + 1) * rank.bytes_per_request + (extra_blocks + 1) * 16 * rank.bytes_per_token
    requests = [TraceRequest(arrival, prompt, output) for arrival, prompt, output in shape]
    for pool in pool_models(rank, budget, seqs, compute_capability=HOPPER).values():
        result = replay(pool, requests, 4096, check_invariants=True)
        assert result.completed + result.refused == len(requests)
        assert result.peak_concurrency <= seqs
