"""The planner's policy against hand-derived figures: what it sizes for, the utilization whole GPUs get, vLLM's
columns per GPU architecture, the vision tower, the state dtype and the refitted reserve."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.sizing import byte_model, catalog_geometry, gpu_spec, parse_hybridmodel, pool_models
from hybridkv.sizing.allocators import pool_model, vllm_align_allocator
from hybridkv.sizing.errors import PlanError, SpecError
from hybridkv.sizing.planner import plan
from hybridkv.sizing.prediction import estimate_reserve_bytes, reserve_calibration
from hybridkv.sizing.quantities import parse_bytes

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def _spec(model="qwen3.5-9b", serving=None, gpu=None):
    return parse_hybridmodel({"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel", "metadata": {"name": "t"},
                              "spec": {"model": {"name": model}, "serving": serving,
                                       "gpu": gpu or {"product": "NVIDIA-H200"}}}, require_source=False)


def test_the_example_plan_is_one_h200_at_095_with_the_full_length_guarantee_beside_it():
    """qwen3.5-9b, one H200, maxModelLen 32768, maxConcurrency 256, by hand:
    requested = ceil(150,109,880,320 × 0.95) = 142,604,386,304 (the total CUDA reports on an H200);
    weights 8,953,803,264 × 2 = 17,907,606,528; reserve = 2,866,692,966 + ceil(1.1941 × 8192 × 28,672) +
    256 × 248,320 × 12 = 3,910,003,437, plus the piecewise graphs at 2048 tokens: arenas 2048 × 2 B × 43,136
    (two sets of (residual, widest projections) = 16,448 and 22,592 columns, and a 4,096-wide core) = 176,685,056
    and ceil(1.1941 × 2048 × 28,672) = 70,117,858, so 4,156,806,351; budget 120,539,973,425; state pool
    257 × 51,511,296 = 13,238,403,072; the prefix cache's checkpoints (on by default), half of 256 slots:
    128 × 51,511,296 = 6,593,445,888; (budget − state − checkpoints) // 524,288 = 192,085 blocks, one null:
    192,084 × 16 = 3,073,344 tokens = 93 requests of 32,768, or 256 at a mean of 12,005. The margin
    0.5 × reserve = 2,078,403,176 B leaves 98 % of the GPU, so the 0.95 ceiling decides."""
    result = plan(_spec(serving={"maxModelLen": 32768, "maxConcurrency": 256}))
    assert (result.tensor_parallel_size, result.gpu_memory_utilization) == (1, "0.95")
    assert result.prediction.reserve_bytes == 4_156_806_351
    assert result.prediction.budget_bytes == 120_539_973_425
    assert result.layout.checkpoint_pool_bytes == 128 * 51_511_296
    assert result.token_capacity == 3_073_344
    assert (result.full_length_requests, result.mean_tokens_all_running) == (93, 12_005)
    assert result.requirement == "vllm-minimum" and result.target_tokens == 32_768
    (guarantee,) = result.alternatives
    assert guarantee["name"] == "full-length" and guarantee["tensor_parallel_size"] == 4
    assert guarantee["target_tokens"] == 256 * 32_768
    why = " ".join(result.reasons)
    assert "93 request(s) at the full 32,768 tokens at once, or all 256 at a mean of 12,005 tokens" in why
    assert "takes 4 × H200 at 0.95" in why and "whole GPUs" in why


def test_guaranteeing_full_length_is_an_explicit_choice_with_its_gpu_count():
    result = plan(_spec(serving={"maxModelLen": 32768, "maxConcurrency": 256, "guaranteeFullLength": True}))
    assert result.tensor_parallel_size == 4 and result.requirement == "full-length"
    assert result.token_capacity >= 256 * 32_768 and result.full_length_requests == 256
    assert result.alternatives == ()


def test_a_workload_is_replayed_and_the_fewest_gpus_within_its_preemption_rate_win():
    serving = {"maxModelLen": 8192, "maxConcurrency": 64,
               "workload": {"promptTokens": {"mean": 3000, "p90": 6000}, "outputTokens": {"mean": 400}}}
    result = plan(_spec("qwen3.5-0.8b", serving, {"product": "NVIDIA-L4"}))
    assert result.requirement == "workload" and result.workload["requests"] == 256
    assert result.workload["completed"] == 256 and result.workload["refused"] == 0
    assert result.workload["preemption_rate"] <= 0.01
    assert any(reason.startswith("serving.workload: 256 requests from log-normal lengths") for reason in result.reasons)
    # The same lengths on a pool too small for them preempt, and the message says by how much.
    tight = {**serving, "maxConcurrency": 64}
    with pytest.raises(PlanError, match=r"replaying serving.workload it preempts .* over the 1.00% allowed "
                                        r".*smallest change: raise gpu.maxPerReplica to 2"):
        plan(_spec("qwen3.5-0.8b", tight, {"product": "NVIDIA-L4", "maxPerReplica": 1}),
             kv_cache_memory_bytes=65 * 19_537_920 + 100_000 * 12_288)


def test_a_histogram_workload_and_its_bounds():
    serving = {"maxModelLen": 4096, "maxConcurrency": 16,
               "workload": {"histogram": [{"promptTokens": 1000, "outputTokens": 100, "weight": 3},
                                          {"promptTokens": 3000, "outputTokens": 500}],
                            "maxPreemptionRate": "0"}}
    result = plan(_spec("qwen3.5-0.8b", serving, {"product": "NVIDIA-L4"}))
    assert result.workload["preemptions"] == 0
    with pytest.raises(SpecError, match="exceed serving.maxModelLen 4096"):
        _spec("qwen3.5-0.8b", {**serving, "workload": {"histogram": [{"promptTokens": 4000, "outputTokens": 200}]}})
    with pytest.raises(SpecError, match="give at most one"):
        _spec("qwen3.5-0.8b", {**serving, "targetTokens": 10_000})


@pytest.mark.parametrize(("gpu", "cuda", "block", "state_blocks"), [
    ("h200", 13, 832, 9), ("h100", 13, 832, 9), ("b200", 13, 832, 9), ("b200", 12, 784, 6),
    ("l40s", 13, 784, 6), ("l4", 13, 784, 6), ("a100-80gb", 13, 784, 6),
])
def test_vllm_align_mode_follows_the_gpu_architecture(gpu, cuda, block, state_blocks):
    """Qwen3.6-27B at tp 2 per rank: a = 2 × 2 × 256 × 2 = 2,048 B per token and layer, g = 1,603,584 B.
    `Platform._align_hybrid_block_size`: B = α·ceil(g / (α·a)): α = 64 (FlashInfer GDN checkpoint grid, SM90, or
    SM100/120 on CUDA 13) gives 64 × 13 = 832; α = 16 (Triton) gives 16 × 49 = 784.
    `MambaSpec.max_memory_usage_bytes` in align mode: 3 blocks per GDN group with the prefill checkpoint, else 2;
    3 GDN groups per request."""
    rank = byte_model(catalog_geometry("qwen3.6-27b"), 2)
    allocator = vllm_align_allocator(gpu_spec(gpu).compute_capability, cuda)
    pool = pool_model(allocator, rank, 40 * GIB, 32)
    assert (pool.block_size, pool.state_units_per_request) == (block, state_blocks)
    assert allocator.rule.startswith(f"SM{''.join(map(str, gpu_spec(gpu).compute_capability))}, CUDA {cuda}: ")


def test_vllm_startup_log_figures():
    """Qwen3.5-4B tp 1 on 10 GiB, maxModelLen 8192. `get_num_blocks`: none mode B = 528, P = 2,162,688, gs = 8, so
    N = 10,737,418,240 // 17,301,504 = 620. `_report_kv_cache_config` (0.20) logs 620 // 4 × 528 = 81,840 tokens;
    `get_max_concurrency_for_kv_cache_config`: 620 / (ceil(8192/528) + 3) = 620 / 19 = 32.63.
    0.33 align on SM90: B = 576, N = 10,737,418,240 // 18,874,368 = 568, per request ceil(8192/576) + 9 = 24:
    568 / 24 = 23.67, `get_kv_cache_capacity` logs int(23.666… × 8192) = 193,877. On SM89 (Triton): B = 528,
    N = 620, per request 16 + 6 = 22: 28.18 and int(620 / 22 × 8192) = 230,865."""
    rank = byte_model(catalog_geometry("qwen3.5-4b"))
    hopper = pool_models(rank, 10 * GIB, 64, compute_capability=(9, 0))
    none = hopper["vllm-0.20-none"].vllm_startup_log(8192)
    assert (none["num_blocks"], none["gpu_kv_cache_tokens"], none["max_concurrency"]) == (620, 81_840, 32.63)
    align = hopper["vllm-0.33-align"].vllm_startup_log(8192)
    assert (align["num_blocks"], align["gpu_kv_cache_tokens"], align["max_concurrency"]) == (568, 193_877, 23.67)
    assert align["lines"] == ["GPU KV cache size: 193,877 tokens",
                              "Maximum concurrency for 8,192 tokens per request: 23.67x"]
    triton = pool_models(rank, 10 * GIB, 64, compute_capability=(8, 9))["vllm-0.33-align"].vllm_startup_log(8192)
    assert (triton["num_blocks"], triton["gpu_kv_cache_tokens"], triton["max_concurrency"]) == (620, 230_865, 28.18)
    assert hopper["hybridkv"].vllm_startup_log(8192) is None


def test_the_vision_tower_is_in_the_vllm_columns_and_not_in_ours():
    """Qwen3.5-4B's tower (depth 27, width 1152, MLP 4304, patch 16 × 16 × 2 frames, 2304 positions, merger
    4608 → 2560): patch 1,770,624 + positions 2,654,208 + 27 blocks × 15,239,504 + merger 33,034,752 + 2,560 +
    norm 2,304 = 448,931,056 parameters, 897,862,112 bytes in bf16. vLLM loads it (`Qwen3_5ForConditionalGeneration`)."""
    assert catalog_geometry("qwen3.5-4b").vision.parameters_per_rank(1) == 448_931_056
    result = plan(_spec("qwen3.5-4b", {"maxModelLen": 8192, "maxConcurrency": 64}))
    assert result.prediction.weights_bytes == 2 * 4_205_751_296  # ours: the text model only
    assert result.vllm_budget_bytes == result.prediction.budget_bytes - 897_862_112
    assert result.allocators["vllm-0.20-none"].budget_bytes == result.vllm_budget_bytes
    assert result.allocators["hybridkv"].budget_bytes == result.prediction.budget_bytes
    assert any("vLLM loads and profiles its vision tower" in reason and "skips it" in reason
               for reason in result.reasons)
    assert catalog_geometry("qwen3-next-80b-a3b").vision is None


def test_the_state_dtype_option_and_what_bfloat16_gains():
    """Qwen3.5-4B per request (`MambaStateShapeCalculator.gated_delta_net_state_shape`): 24 layers × (3 × 8,192 conv
    × 2 B + 32 × 128 × 128 × recurrent bytes): 51,511,296 B in float32, 26,345,472 B in bfloat16."""
    serving = {"maxModelLen": 8192, "maxConcurrency": 256}
    fp32 = plan(_spec("qwen3.5-4b", serving))
    bf16 = plan(_spec("qwen3.5-4b", {**serving, "ssmStateDtype": "bfloat16"}))
    assert (fp32.prediction.rank_bytes.bytes_per_request, bf16.prediction.rank_bytes.bytes_per_request) == (
        51_511_296, 26_345_472)
    assert fp32.to_dict()["ssm_state_dtype"] == "float32" and bf16.to_dict()["ssm_state_dtype"] == "bfloat16"
    assert fp32.state_dtypes == bf16.state_dtypes == {"float32": fp32.token_capacity, "bfloat16": bf16.token_capacity}
    # 257 state slots and (prefix caching on) 128 checkpoints × 25,165,824 B saved = 9,688,842,240 B
    # = 18,480 blocks of 16 tokens
    assert bf16.token_capacity - fp32.token_capacity == 18_480 * 16


def test_the_reserve_is_fitted_on_two_geometries_and_checked_on_a_third():
    """bench/calibrate_reserve.py fits fixed + activation × elements on Qwen3.5-0.8B and 9B (3.72 and 3.91 GB
    measured) and predicts the held-out 4B start-up (throughput-2026-11-29.json) within 0.3 % of its capacity."""
    spec = importlib.util.spec_from_file_location("calibrate_reserve", ROOT / "bench" / "calibrate_reserve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    runs = module.read_startups([ROOT / "bench" / "results" / "startups-2026-11-29.json"])
    fitted = [run for run in runs if run.model != "qwen3.5-4b"]
    calibration = module.fit(fitted)
    assert calibration == reserve_calibration()  # reserve.json is what the script writes from these runs
    rows = {row["model"]: row for row in module.report_rows(runs, calibration, fitted)}
    assert rows["qwen3.5-4b"]["role"] == "check"
    assert abs(rows["qwen3.5-4b"]["capacity_error"]) < 0.003
    assert rows["qwen3.5-4b"]["measured_token_capacity"] == 3_342_272
    for model in ("qwen3.5-0.8b", "qwen3.5-9b"):
        assert abs(rows[model]["reserve_error_bytes"]) < 1_000_000
    # Those start-ups ran mixed steps eagerly: no piecewise graphs in the reserve they measured.
    eager = estimate_reserve_bytes(catalog_geometry("qwen3.5-4b"), 1, 8192, 256, piecewise_tokens=0)
    assert eager == rows["qwen3.5-4b"]["estimated_reserve_bytes"]


def _calibrate_reserve_module():
    spec = importlib.util.spec_from_file_location("calibrate_reserve", ROOT / "bench" / "calibrate_reserve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_held_out_start_ups_are_checked_never_fitted(monkeypatch, capsys):
    """The 2026-12-06 and 2026-12-07 start-ups (Qwen3.5-35B-A3B at 32 sequences among them, and a Qwen3.5-0.8B run,
    a model the fit also has a run of) are all checks; the fit is the 2026-11-29 one, and every held-out capacity is
    within 1 %."""
    module = _calibrate_reserve_module()
    results = ROOT / "bench" / "results"
    monkeypatch.setattr(sys, "argv", ["calibrate_reserve.py", str(results / "startups-2026-11-29.json"), "--check",
                                      "qwen3.5-4b", "--held-out", str(results / "startups-2026-12-06-h100.json"),
                                      "--held-out", str(results / "startups-2026-12-07-h100.json"), "--json"])
    module.main()
    out = json.loads(capsys.readouterr().out)
    assert out["calibration"]["fixed_bytes"] == reserve_calibration().fixed_bytes
    fitted, held_out = out["runs"][:3], out["runs"][3:]  # the 2026-11-29 file's three runs come first
    assert [row["role"] for row in fitted] == ["fit", "fit", "check"] and len(held_out) == 9
    assert {row["role"] for row in held_out} == {"check"}
    assert {(row["model"], row["max_num_seqs"]) for row in held_out} >= {("qwen3.5-35b-a3b", 32),
                                                                          ("qwen3.5-0.8b", 256)}
    assert all(abs(row["capacity_error"]) < 0.01 for row in held_out)


def test_a_fit_without_two_geometries_is_a_specific_error(monkeypatch, capsys):
    module = _calibrate_reserve_module()
    monkeypatch.setattr(sys, "argv", ["calibrate_reserve.py", str(ROOT / "bench" / "results" /
                                                                  "startups-2026-11-29.json"),
                                      "--check", "qwen3.5-0.8b", "--check", "qwen3.5-4b"])
    with pytest.raises(SystemExit) as info:
        module.main()
    assert info.value.code == 2
    assert "the fit needs start-ups of at least two geometries" in capsys.readouterr().err


def test_whole_gpu_utilization_leaves_the_margin_free_on_a_small_gpu():
    """Qwen3.5-0.8B on an L4 (23,034 MiB = 24,152,899,584 B): reserve 1,595,294,566 + ceil(1.1941 × 8192 × 9,248)
    + 32 × 248,320 × 32 = 1,940,038,804, plus the piecewise graphs at 2048 tokens (arenas 2048 × 2 B × 23,616 =
    96,731,136 and ceil(1.1941 × 2048 × 9,248) = 22,616,140): 2,059,386,080; margin 1,029,693,040 B;
    floor(100 × (1 − margin / total)) = 95."""
    result = plan(_spec("qwen3.5-0.8b", {"maxModelLen": 4096, "maxConcurrency": 32}, {"product": "NVIDIA-L4"}))
    assert result.safety_margin_bytes == 1_029_693_040
    assert result.gpu_memory_utilization == "0.95"


def test_kv_cache_memory_takes_quantities_and_the_plan_says_what_it_holds(capsys):
    assert parse_bytes("8Gi") == 8 * GIB and parse_bytes("268435456") == 268_435_456
    assert main(["plan", "--kv-cache-memory", "24Gi", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget_bytes"] == 24 * GIB and data["kv_cache_memory_bytes"] == 24 * GIB
    assert data["allocators"]["vllm-0.33-align"]["vllm_startup_log"]["lines"][0].startswith("GPU KV cache size: ")


def test_plan_help_states_the_policy(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("what vLLM itself requires", "--guarantee-full-length", "whole GPUs get the highest utilization",
                   "--shared-gpu takes the lowest"):
        assert phrase in text
