"""The byte model per rank against constants worked by hand from vLLM's formulas for every catalog model and valid tp."""

from __future__ import annotations

import math

import pytest

from hybridkv.sizing import (
    TensorParallelError,
    byte_model,
    catalog_geometry,
    catalog_names,
    check_tensor_parallel_size,
    shared_pool_geometry,
    valid_tensor_parallel_sizes,
)

# Worked by hand from vLLM's formulas and the published configs, at TP1 (bf16 KV; fp32 recurrent state for Qwen3.5/3.6, bf16 for Qwen3-Next), with the KV heads
# of the configs: model -> (L_a, L_g, kv_heads, a, bytes/token, g, state MiB/request, B none, P, pad %, pool bytes/block,
# state token-equivalents/request)
REFERENCE_TP1 = {
    "qwen3.5-0.8b": (6, 18, 2, 2048, 12_288, 1_085_440, 18.63, 544, 1_114_112, 2.64, 6_684_672, 1632),
    "qwen3.5-2b": (6, 18, 2, 2048, 12_288, 1_085_440, 18.63, 544, 1_114_112, 2.64, 6_684_672, 1632),
    "qwen3.5-4b": (8, 24, 4, 4096, 32_768, 2_146_304, 49.12, 528, 2_162_688, 0.76, 17_301_504, 1584),
    "qwen3.5-9b": (8, 24, 4, 4096, 32_768, 2_146_304, 49.12, 528, 2_162_688, 0.76, 17_301_504, 1584),
    "qwen3.5-27b": (16, 48, 4, 4096, 65_536, 3_207_168, 146.81, 784, 3_211_264, 0.13, 51_380_224, 2352),
    "qwen3.6-27b": (16, 48, 4, 4096, 65_536, 3_207_168, 146.81, 784, 3_211_264, 0.13, 51_380_224, 2352),
    "qwen3.5-35b-a3b": (10, 30, 2, 2048, 20_480, 2_146_304, 61.41, 1056, 2_162_688, 0.76, 21_626_880, 3168),
    "qwen3-next-80b-a3b": (12, 36, 2, 2048, 24_576, 1_097_728, 37.69, 544, 1_114_112, 1.49, 13_369_344, 1632),
}
TP_VALUES = (1, 2, 4, 8)


def test_reference_covers_the_whole_catalog():
    assert set(REFERENCE_TP1) == set(catalog_names())


def _expected(name: str, tp: int) -> dict:
    """The hand-worked TP1 row carried to `tp` by the per-rank rules: KV heads split or replicated, GDN state split by tp."""
    layers_a, layers_g, kv_heads, a1, _, g1, _, _, _, _, _, _ = REFERENCE_TP1[name]
    a = a1 * max(1, kv_heads // tp) // kv_heads
    g = g1 // tp
    block = 16 * math.ceil(g / (16 * a))
    return {
        "a": a,
        "bytes_per_token": layers_a * a,
        "g": g,
        "bytes_per_request": layers_g * g,
        "block": block,
        "page": block * a,
        "pool_block": layers_a * block * a,
        "state_tokens": 3 * block,
    }


@pytest.mark.parametrize("name", sorted(REFERENCE_TP1))
def test_tp1_row_reproduces_the_reference_table(name):
    layers_a, layers_g, _, a, bpt, g, mib, block, page, pad, pool_block, state_tokens = REFERENCE_TP1[name]
    rank = byte_model(catalog_geometry(name))
    assert (rank.num_full_attention_layers, rank.num_linear_attention_layers) == (layers_a, layers_g)
    assert rank.kv_bytes_per_token_per_layer == a
    assert rank.bytes_per_token == bpt
    assert rank.state_bytes_per_layer == g
    assert round(rank.bytes_per_request / 2**20, 2) == mib
    shared = shared_pool_geometry(rank, 16)
    assert (shared.block_size, shared.page_bytes, shared.block_bytes) == (block, page, pool_block)
    assert round(100 * shared.padding_fraction, 2) == pad
    assert shared.attention_groups + shared.gdn_groups == 4
    assert shared.gdn_groups * shared.block_size == state_tokens


@pytest.mark.parametrize("name", sorted(REFERENCE_TP1))
@pytest.mark.parametrize("tp", TP_VALUES)
def test_every_valid_tp_follows_the_reference_rules(name, tp):
    geometry = catalog_geometry(name)
    assert tp in valid_tensor_parallel_sizes(geometry, 8)
    rank = byte_model(geometry, tp)
    expected = _expected(name, tp)
    assert rank.kv_bytes_per_token_per_layer == expected["a"]
    assert rank.bytes_per_token == expected["bytes_per_token"]
    assert rank.state_bytes_per_layer == expected["g"]
    assert rank.bytes_per_request == expected["bytes_per_request"]
    shared = shared_pool_geometry(rank, 16)
    assert (shared.block_size, shared.page_bytes, shared.block_bytes) == (
        expected["block"], expected["page"], expected["pool_block"]
    )
    assert shared.gdn_groups * shared.block_size == expected["state_tokens"]


def test_27b_tp2_row_of_the_reference():
    rank = byte_model(catalog_geometry("qwen3.5-27b"), tp=2)
    shared = shared_pool_geometry(rank, 16)
    assert (rank.kv_bytes_per_token_per_layer, rank.bytes_per_token) == (2048, 32_768)
    assert rank.state_bytes_per_layer == 1_603_584
    assert round(rank.bytes_per_request / 2**20, 2) == 73.41
    assert (shared.block_size, shared.page_bytes, shared.block_bytes) == (784, 1_605_632, 25_690_112)


def test_fp8_kv_at_tp2_gives_the_1568_token_block_seen_in_logs():
    rank = byte_model(catalog_geometry("qwen3.6-27b"), tp=2, kv_dtype="fp8")
    assert rank.kv_bytes_per_token_per_layer == 1024
    assert shared_pool_geometry(rank, 16).block_size == 1568


def test_align_mode_block_on_hopper_is_576_with_about_ten_percent_padding():
    shared = shared_pool_geometry(byte_model(catalog_geometry("qwen3.5-4b")), 64)
    assert shared.block_size == 576
    assert round(100 * shared.padding_fraction, 1) == 9.9


def test_state_dtypes_default_from_the_config_and_can_be_overridden():
    four = catalog_geometry("qwen3.5-4b")
    assert byte_model(four).ssm_dtype == "float32"
    assert byte_model(four, ssm_dtype="bf16").bytes_per_request == 26_345_472  # bf16 recurrent state: half the fp32 state
    assert byte_model(catalog_geometry("qwen3-next-80b-a3b")).ssm_dtype == "bfloat16"
    assert byte_model(catalog_geometry("qwen3-next-80b-a3b"), ssm_dtype="float32").state_bytes_per_layer == 2_146_304


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    rank = byte_model(catalog_geometry("qwen3.5-4b"), tp=8)
    assert rank.kv_heads_per_rank == 1
    assert rank.bytes_per_token == 8 * 2 * 1 * 256 * 2


@pytest.mark.parametrize(
    ("name", "tp", "message"),
    [
        ("qwen3.5-4b", 3, "tp=3 does not divide the 16 attention query heads"),
        ("qwen3.5-27b", 3, "does not divide the 16 GDN key heads"),
        ("qwen3.5-4b", 0, "integer in \\[1, 64\\]"),
        ("qwen3.5-4b", True, "integer"),
        ("qwen3.5-0.8b", 16, "tp=16 does not divide the 8 attention query heads"),
    ],
)
def test_invalid_tp_says_why_and_lists_the_valid_ones(name, tp, message):
    with pytest.raises(TensorParallelError, match=message):
        check_tensor_parallel_size(catalog_geometry(name), tp)
    if not isinstance(tp, bool) and tp > 0:
        with pytest.raises(TensorParallelError, match="valid tp: 1, 2, 4, 8"):
            byte_model(catalog_geometry(name), tp)
