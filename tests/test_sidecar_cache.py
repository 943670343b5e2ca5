"""Capacity truth: what the engine reports is what it allocated and what it can really hold.

The expected figures are derived here from config.json (bytes per token and per request for fp32 pools), not read
back from the engine's own arithmetic.
"""

from __future__ import annotations

import pytest
from engine_fixtures import make_engine, pool_budget, tiny_checkpoint  # noqa: F401 (fixture)

from hybridkv.sidecar.core.sampling import SamplingParams

BLOCK_SIZE = 16
TOKEN_BLOCKS = 12
STATE_SLOTS = 5


@pytest.fixture
def filled_engine(tiny_checkpoint):
    budget = pool_budget(tiny_checkpoint, STATE_SLOTS, TOKEN_BLOCKS, BLOCK_SIZE)
    return make_engine(tiny_checkpoint, max_num_seqs=STATE_SLOTS, kv_cache_memory_bytes=budget,
                       block_size=BLOCK_SIZE, max_num_batched_tokens=1024)


def allocated_bytes(tensor_pairs) -> int:
    return sum(t.numel() * t.element_size() for pair in tensor_pairs for t in pair)


def test_reported_pool_bytes_are_the_allocated_tensors_and_fit_the_budget(filled_engine, tiny_checkpoint):
    report = filled_engine.capacity().to_dict()
    budget = pool_budget(tiny_checkpoint, STATE_SLOTS, TOKEN_BLOCKS, BLOCK_SIZE)
    assert (report["token_blocks"], report["state_slots"], report["block_size"]) == (TOKEN_BLOCKS, STATE_SLOTS,
                                                                                      BLOCK_SIZE)
    assert report["token_capacity"] == TOKEN_BLOCKS * BLOCK_SIZE
    assert report["token_pool_bytes"] == allocated_bytes(filled_engine.cache.kv_caches)
    assert report["state_pool_bytes"] == allocated_bytes(filled_engine.cache.state_caches)
    assert report["token_pool_bytes"] + report["state_pool_bytes"] == budget == report["budget_bytes"]
    # Null block and null slot are allocated but not counted as capacity.
    assert filled_engine.cache.kv_caches[0][0].shape[0] == TOKEN_BLOCKS + 1
    assert filled_engine.cache.state_caches[0][0].shape[0] == STATE_SLOTS + 1
    assert report["per_rank"] == [{key: report[key] for key in report["per_rank"][0]}]
    # With a fixed budget the planner's prediction is the same layout: same bytes, same arithmetic.
    predicted = report["predicted"]
    assert (predicted["token_blocks"], predicted["state_slots"], predicted["budget_bytes"]) == (
        TOKEN_BLOCKS, STATE_SLOTS, budget)


def test_a_budget_short_of_another_block_allocates_no_partial_block(tiny_checkpoint):
    exact = pool_budget(tiny_checkpoint, STATE_SLOTS, TOKEN_BLOCKS, BLOCK_SIZE)
    block_bytes = pool_budget(tiny_checkpoint, STATE_SLOTS, TOKEN_BLOCKS + 1, BLOCK_SIZE) - exact
    engine = make_engine(tiny_checkpoint, max_num_seqs=STATE_SLOTS, kv_cache_memory_bytes=exact + block_bytes - 1,
                         block_size=BLOCK_SIZE)
    report = engine.capacity()
    assert report.token_blocks == TOKEN_BLOCKS and report.budget_bytes == exact + block_bytes - 1
    assert report.token_pool_bytes + report.state_pool_bytes == exact < report.budget_bytes


def test_cpu_without_a_fixed_budget_uses_the_documented_default(tiny_checkpoint):
    from hybridkv.sidecar.core.config import DEFAULT_CPU_KV_CACHE_MEMORY_BYTES

    engine = make_engine(tiny_checkpoint, kv_cache_memory_bytes=None)
    report = engine.capacity()
    assert report.budget_bytes == DEFAULT_CPU_KV_CACHE_MEMORY_BYTES == 64 * 2**20
    assert report.token_pool_bytes + report.state_pool_bytes <= report.budget_bytes
    assert not report.memory_measured and report.reserve_bytes == 0  # nothing to measure without a GPU


def test_filled_engine_holds_exactly_the_reported_tokens(filled_engine):
    """Four prompts of three blocks each fill all twelve blocks; a fifth request has a free slot but no block left
    and must wait."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt_len = 3 * BLOCK_SIZE
    for index in range(5):
        filled_engine.add_request(f"r{index}", [5 + index] * prompt_len, params)
    filled_engine.step()
    filled_engine.check_invariants()
    report = filled_engine.capacity().to_dict()
    held_tokens = sum(seq.num_computed_tokens for seq in filled_engine.scheduler.running)
    assert held_tokens == report["token_capacity"]
    assert report["usage"]["used_token_blocks"] == report["token_blocks"]
    assert report["usage"] == {"used_token_blocks": TOKEN_BLOCKS, "cached_token_blocks": 0, "used_state_slots": 4,
                               "used_checkpoint_slots": 0, "running": 4, "waiting": 1}


def test_filled_engine_holds_exactly_the_reported_slots(filled_engine):
    """Short prompts: slots run out first; the engine runs exactly state_slots requests and queues the rest."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for index in range(STATE_SLOTS + 3):
        filled_engine.add_request(f"r{index}", [9, index + 3], params)
    filled_engine.step()
    filled_engine.check_invariants()
    usage = filled_engine.capacity().to_dict()["usage"]
    assert usage["running"] == usage["used_state_slots"] == filled_engine.capacity().state_slots == STATE_SLOTS
    assert usage["waiting"] == 3
    assert usage["used_token_blocks"] == STATE_SLOTS  # one block per 2-token prompt


def test_preempted_and_finished_requests_return_everything(filled_engine):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for index in range(4):
        filled_engine.add_request(f"r{index}", [5 + index] * (3 * BLOCK_SIZE - 1), params)
    while filled_engine.has_unfinished_requests():
        filled_engine.step()
        filled_engine.check_invariants()
        usage = filled_engine.capacity().usage
        assert usage["used_token_blocks"] <= TOKEN_BLOCKS and usage["used_state_slots"] <= STATE_SLOTS
    assert filled_engine.stats().preemptions_total > 0
    assert filled_engine.capacity().usage == {"used_token_blocks": 0, "cached_token_blocks": 0, "used_state_slots": 0,
                                              "used_checkpoint_slots": 0, "running": 0, "waiting": 0}


def test_state_copies_and_zeroing_reach_every_gdn_layer_and_only_the_slots_named():
    """The state and checkpoint pools are each one tensor per kind with the GDN layers first; every layer's view is
    its own slots, and one copy or fill over the stack moves exactly the named slots of every layer."""
    import torch

    from hybridkv.sidecar.core.cache import CacheManager
    from hybridkv.sizing import PoolShapes

    shapes = PoolShapes(num_full_attention_layers=1, num_linear_attention_layers=3, kv_token_shape=(1, 2),
                        conv_slot_shape=(4, 3), ssm_slot_shape=(2, 2, 2), kv_dtype="float32", conv_dtype="float32",
                        ssm_dtype="float32")
    cache = CacheManager(4, 5, 16, shapes, torch.device("cpu"), checkpoint_slots=3)
    pairs = cache.state_caches + cache.checkpoint_caches
    assert len(cache.state_caches) == len(cache.checkpoint_caches) == 3
    assert all(t.is_contiguous() for pair in pairs for t in pair)
    generator = torch.Generator().manual_seed(0)
    for tensor in (t for pair in pairs for t in pair):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    before = [[t.clone() for t in pair] for pair in pairs]

    cache.save_checkpoints([(4, 2), (1, 0)])  # state slot 4 -> checkpoint 2, state slot 1 -> checkpoint 0
    for layer, (state, checkpoint) in enumerate(zip(cache.state_caches, cache.checkpoint_caches)):
        for kind in range(2):
            assert torch.equal(checkpoint[kind][2], before[layer][kind][4])
            assert torch.equal(checkpoint[kind][0], before[layer][kind][1])
            assert torch.equal(checkpoint[kind][1], before[3 + layer][kind][1])  # untouched
            assert torch.equal(state[kind], before[layer][kind])

    cache.restore_checkpoints([(2, 3)])  # checkpoint 2 (state slot 4's) -> state slot 3
    cache.zero_slots([1])
    for layer, state in enumerate(cache.state_caches):
        for kind in range(2):
            assert torch.equal(state[kind][3], before[layer][kind][4])
            assert not state[kind][1].any()
            for slot in (0, 2, 4, 5):
                assert torch.equal(state[kind][slot], before[layer][kind][slot])


@pytest.mark.parametrize("num_tokens", [0, 15, 16, 17, 48, 50])
def test_block_hashes_chain_sha256_over_each_full_blocks_int64_ids(num_tokens):
    """The definition, block by block: SHA-256 of the previous hash and the block's ids as little-endian int64."""
    import hashlib
    import struct

    from hybridkv.sidecar.core.cache import chain_block_hashes

    ids = [(7919 * i) % 151_000 for i in range(num_tokens)]
    expected, parent = [], b"root"
    for start in range(0, num_tokens - 15, 16):
        parent = hashlib.sha256(parent + struct.pack("<16q", *ids[start:start + 16])).digest()
        expected.append(parent)
    assert chain_block_hashes(b"root", ids, 16) == expected
    assert len(expected) == num_tokens // 16
