"""The three allocators against hand-worked H200 figures for Qwen3.5-4B/9B, and the dual pool's counting conventions."""

from __future__ import annotations

import pytest

from hybridkv.sizing import (
    DUAL_POOL,
    IDEAL,
    VLLM_0_20_NONE,
    VLLM_0_33_ALIGN,
    CapacityError,
    byte_model,
    catalog_geometry,
    dual_pool_layout,
    dual_pool_max_concurrency,
    pool_model,
    pool_models,
)

# Hand-worked H200 figures at the central reserve R: (model, S, legacy N, legacy tokens with S resident, legacy tokens with 1 resident,
# v0.20 log, seed tokens (B = 528 compact pool), ideal tokens)
H200_ROWS = [
    ("qwen3.5-4b", 256, 7055, 3_319_008, 3_722_928, 930_864, 3_320_592, 3_323_001),
    ("qwen3.5-4b", 1024, 6869, 2_004_288, 3_624_720, 906_576, 2_014_848, 2_017_401),
    ("qwen3.5-9b", 256, 6506, 3_029_136, 3_433_056, 858_528, 3_030_192, 3_032_771),
    ("qwen3.5-9b", 1024, 6319, 1_713_888, 3_334_320, 833_712, 1_724_976, 1_727_171),
]

HOPPER = (9, 0)  # H100/H200: vLLM 0.33 runs FlashInfer's GDN prefill


def _budget_from_ideal(rank, max_num_seqs: int, ideal_tokens: int) -> int:
    """The KV budget A implied by the hand-worked ideal column: (A − S·bytes_per_request) / bytes_per_token = ideal."""
    return max_num_seqs * rank.bytes_per_request + ideal_tokens * rank.bytes_per_token


@pytest.mark.parametrize(("name", "seqs", "blocks", "legacy", "legacy_one", "log_v020", "seed", "ideal"), H200_ROWS)
def test_h200_rows_of_the_reference(name, seqs, blocks, legacy, legacy_one, log_v020, seed, ideal):
    rank = byte_model(catalog_geometry(name))
    budget = _budget_from_ideal(rank, seqs, ideal)
    models = pool_models(rank, budget, seqs, compute_capability=HOPPER)
    vllm = models[VLLM_0_20_NONE.key]
    assert vllm.pool_units + 1 == blocks
    assert vllm.token_capacity(seqs) == legacy
    assert vllm.token_capacity(1) == legacy_one
    assert (blocks // 4) * vllm.block_size == log_v020
    assert models[IDEAL.key].token_capacity(seqs) == ideal
    # The compact pool of the proposal keeps vLLM's 528-token block: the dual pool with block_size=528.
    assert pool_model(DUAL_POOL, rank, budget, seqs, block_size=528).token_capacity(seqs) == seed
    # At full concurrency the layouts differ by under 1 %.
    ours = models[DUAL_POOL.key].token_capacity(seqs)
    assert legacy <= ours <= ideal
    assert (ideal - legacy) / ideal < 0.01


def test_v033_align_mode_on_h200_matches_the_reference():
    rank = byte_model(catalog_geometry("qwen3.5-4b"))
    budget = _budget_from_ideal(rank, 256, 3_323_001)
    align = pool_model(VLLM_0_33_ALIGN, rank, budget, 256)
    assert (align.block_size, align.pool_units + 1) == (576, 6467)
    assert round(align.token_capacity(256) / 1e6, 2) == 2.40  # 9 state blocks per request at admission
    budget_1024 = _budget_from_ideal(rank, 1024, 2_017_401)
    align_1024 = pool_model(VLLM_0_33_ALIGN, rank, budget_1024, 1024)
    assert align_1024.pool_units // align_1024.state_units_per_request == 699  # "about 700 requests"
    assert align_1024.token_capacity(1024) == 0


def test_dual_pool_counts_usable_and_reports_allocated_bytes():
    rank = byte_model(catalog_geometry("qwen3.5-4b"))
    block_bytes = 16 * rank.bytes_per_token
    budget = 257 * rank.bytes_per_request + 1001 * block_bytes + 123
    layout = dual_pool_layout(rank, budget, 256)
    assert (layout.state_slots, layout.token_blocks, layout.token_capacity) == (256, 1000, 16_000)
    assert layout.state_pool_bytes == 257 * rank.bytes_per_request
    assert layout.token_pool_bytes == 1001 * block_bytes
    assert layout.unused_bytes == 123
    assert layout.state_pool_usable_bytes == 256 * rank.bytes_per_request


def test_dual_pool_budget_too_small_says_what_it_needs():
    rank = byte_model(catalog_geometry("qwen3.5-9b"))
    budget = 1025 * rank.bytes_per_request + 16 * rank.bytes_per_token  # room for the null block only
    with pytest.raises(CapacityError, match="cannot hold 1024 state slots.*lower max_num_seqs"):
        dual_pool_layout(rank, budget, 1024)


def test_breakdown_accounts_for_every_byte_of_the_budget():
    rank = byte_model(catalog_geometry("qwen3.5-27b"), tp=2)
    budget = 40 * 2**30 + 12345
    for model in pool_models(rank, budget, 128, compute_capability=HOPPER).values():
        for running in (0, 1, 64, 128):
            parts = model.breakdown(running)
            assert sum(parts.values()) == budget
            assert all(value >= 0 for value in parts.values())
            assert parts["token_bytes"] >= model.token_capacity(running) * rank.bytes_per_token


def test_small_blocks_beat_inflated_blocks_when_requests_are_short():
    """600-token requests: vLLM holds 2 × 528 tokens each (plus 3 state blocks); 16-token blocks hold 608."""
    rank = byte_model(catalog_geometry("qwen3.5-4b"))
    budget = _budget_from_ideal(rank, 1024, 2_017_401)
    models = pool_models(rank, budget, 1500, compute_capability=HOPPER)
    ours = models[DUAL_POOL.key].max_concurrency(600)
    vllm = models[VLLM_0_20_NONE.key].max_concurrency(600)
    assert vllm == (6869 - 1) // (2 + 3)
    assert ours == 1500 > vllm
    assert models[IDEAL.key].max_concurrency(600) >= ours


@pytest.mark.parametrize("request_tokens", [1, 16, 17, 600, 8192, 131_072])
def test_dual_pool_sized_for_a_length_holds_exactly_that_many(request_tokens):
    rank = byte_model(catalog_geometry("qwen3.5-9b"), tp=2)
    budget = 60 * 2**30 + 777
    most = dual_pool_max_concurrency(rank, budget, request_tokens)
    assert pool_model(DUAL_POOL, rank, budget, most).max_concurrency(request_tokens) == most
    try:
        one_more = pool_model(DUAL_POOL, rank, budget, most + 1).max_concurrency(request_tokens)
    except CapacityError:
        one_more = 0
    assert one_more < most + 1


# Hand-worked bands: millions of tokens for (legacy with S resident, compact pool, ideal) at the low and the high reserve.
H200_BANDS = [
    ("qwen3.5-4b", 256, 3_323_001, (1.0, (3.352, 3.353, 3.356)), (-1.5, (3.270, 3.271, 3.274))),
    ("qwen3.5-4b", 1024, 2_017_401, (2.0, (2.070, 2.080, 2.083)), (-3.0, (1.906, 1.917, 1.919))),
    ("qwen3.5-9b", 256, 3_032_771, (1.0, (3.062, 3.063, 3.066)), (-1.5, (2.980, 2.981, 2.984))),
    ("qwen3.5-9b", 1024, 1_727_171, (2.0, (1.780, 1.790, 1.793)), (-3.0, (1.616, 1.626, 1.629))),
]


@pytest.mark.parametrize(("name", "seqs", "ideal", "low", "high"), H200_BANDS)
def test_h200_reserve_bands_of_the_reference(name, seqs, ideal, low, high):
    """A reserve lower (higher) than the central one by ΔR GiB gives the allocators ΔR GiB more (less) budget."""
    rank = byte_model(catalog_geometry(name))
    central = _budget_from_ideal(rank, seqs, ideal)
    for shift_gib, expected in (low, high):
        budget = central + round(shift_gib * 2**30)
        models = pool_models(rank, budget, seqs, compute_capability=HOPPER)
        legacy = models[VLLM_0_20_NONE.key].token_capacity(seqs)
        compact = pool_model(DUAL_POOL, rank, budget, seqs, block_size=528).token_capacity(seqs)
        bound = models[IDEAL.key].token_capacity(seqs)
        assert tuple(round(tokens / 1e6, 3) for tokens in (legacy, compact, bound)) == expected


def test_vllm_log_of_issue_40691_follows_from_1487_blocks():
    """vLLM issue #40691: Qwen3.5-27B, max_model_len 32768, v0.19 logged 290,864 tokens and 33.04× concurrency."""
    rank = byte_model(catalog_geometry("qwen3.5-27b"))
    vllm = pool_model(VLLM_0_20_NONE, rank, 1487 * 51_380_224 + 12_345, 16)
    assert vllm.pool_units + 1 == 1487
    assert ((vllm.pool_units + 1) // 4) * vllm.block_size == 290_864
    assert round((vllm.pool_units + 1) / (vllm.units_for_request(32_768)), 2) == 33.04
    assert vllm.max_concurrency(32_768) == 16  # the scheduler's max_num_seqs caps the 33 that fit
