"""The planner and the `hybridkv plan` / `hybridkv simulate` commands, as a user sees them."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.sizing import (
    GeometryError,
    PlanError,
    SpecError,
    TensorParallelError,
    byte_model,
    catalog_entry,
    catalog_geometry,
    gpu_spec,
    kv_cache_dtype,
    parse_hybridmodel,
)
from hybridkv.sizing.errors import UnknownModelError
from hybridkv.sizing.planner import plan

PRIMITIVES = (
    "bytes_per_token", "bytes_per_request", "weights_bytes", "reserve_bytes", "budget_bytes", "state_slots",
    "token_blocks", "block_size",
)
ALLOCATOR_KEYS = ("hybridkv", "vllm-0.20-none", "vllm-0.33-align", "ideal")


def _spec(model="qwen3.5-4b", gpu=None, serving=None, overrides=None, **spec_fields):
    spec = {"model": {"name": model, "source": {"uri": "hf://Qwen/Qwen3.5-4B"}},
            "serving": serving or {"maxModelLen": 8192, "maxConcurrency": 256},
            "gpu": gpu or {"product": "NVIDIA-H200"}}
    if overrides:
        spec["overrides"] = overrides
    spec.update(spec_fields)
    return parse_hybridmodel({"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel",
                              "metadata": {"name": "t"}, "spec": spec})


def test_shared_gpu_takes_the_lowest_utilization_that_holds_the_target():
    required = {"maxModelLen": 8192, "maxConcurrency": 256, "targetTokens": 256 * 8192}
    result = plan(_spec(serving=required, gpu={"product": "NVIDIA-H200", "shared": True}))
    assert result.tensor_parallel_size == 1 and result.requirement == "target"
    assert result.max_num_seqs == 256 and result.layout.state_slots == 256
    assert result.token_capacity >= result.target_tokens == 256 * 8192
    assert any("spec.gpu.shared says the GPU is shared" in reason for reason in result.reasons)
    lower = f"0.{int(result.gpu_memory_utilization[2:]) - 1:02d}"
    with pytest.raises(PlanError, match=f"utilization {lower}"):
        plan(_spec(serving=required, overrides={"gpuMemoryUtilization": lower, "tensorParallelSize": 1}))


def test_plan_json_carries_the_primitives_and_every_allocator():
    data = plan(_spec()).to_dict()
    for key in PRIMITIVES:
        assert isinstance(data[key], int), key
    assert data["gpu_memory_utilization"].startswith("0.")
    assert set(data["allocators"]) == set(ALLOCATOR_KEYS)
    for figures in data["allocators"].values():
        assert isinstance(figures["token_capacity"], int)
    assert data["allocators"]["hybridkv"]["token_capacity"] == data["token_capacity"]
    assert data["allocators"]["vllm-0.20-none"]["block_size"] == 528
    # allocated bytes include the null slot / block; usable bytes do not
    assert data["state_pool_bytes"] - data["state_pool_usable_bytes"] == data["bytes_per_request"]
    assert data["token_pool_bytes"] - data["token_pool_usable_bytes"] == 16 * data["bytes_per_token"]
    rank = byte_model(catalog_geometry("qwen3.5-4b"))
    assert (data["bytes_per_token"], data["bytes_per_request"]) == (rank.bytes_per_token, rank.bytes_per_request)


def test_27b_on_l4_needs_four_gpus():
    result = plan(_spec("qwen3.6-27b", gpu={"product": "NVIDIA-L4", "maxPerReplica": 4},
                        serving={"maxModelLen": 32768, "maxConcurrency": 8}))
    assert result.tensor_parallel_size == 4
    assert "tp 1, 2 cannot" in result.reasons[0]


def test_weights_that_fit_on_no_allowed_tp_give_the_specific_error():
    with pytest.raises(PlanError) as info:
        plan(_spec("qwen3.5-27b", gpu={"product": "NVIDIA-L4", "maxPerReplica": 2},
                   serving={"maxModelLen": 8192, "maxConcurrency": 8}))
    assert str(info.value) == (
        "Qwen3.5-27B needs 50.1 GiB of text-model weights per GPU at tp=1; at utilization 0.95 (the highest that "
        "leaves the safety margin free), an L4 gives 21.4 GiB; smallest change: raise gpu.maxPerReplica to 4"
    )


def test_explicit_target_that_cannot_fit_names_the_target_and_the_largest_that_fits():
    with pytest.raises(PlanError) as info:
        plan(_spec(serving={"maxModelLen": 8192, "maxConcurrency": 256, "targetTokens": 100_000_000},
                   gpu={"product": "NVIDIA-H200", "maxPerReplica": 1}))
    message = str(info.value)
    assert "short of the 100,000,000 tokens of serving.targetTokens" in message
    assert "(gpu.maxPerReplica allows 1)" in message
    held = int(re.search(r"and ([\d,]+) tokens with the safety margin", message).group(1).replace(",", ""))
    assert f"lower serving.targetTokens to {held:,}" in message
    assert plan(_spec(serving={"maxModelLen": 8192, "maxConcurrency": 256, "targetTokens": held},
                      gpu={"product": "NVIDIA-H200", "maxPerReplica": 1})).tensor_parallel_size == 1


def test_overrides_are_honoured_or_rejected_with_a_reason():
    result = plan(_spec(overrides={"tensorParallelSize": 2, "gpuMemoryUtilization": "0.90", "maxNumSeqs": 300}))
    assert (result.tensor_parallel_size, result.gpu_memory_utilization, result.max_num_seqs) == (2, "0.90", 300)
    with pytest.raises(TensorParallelError, match="overrides.tensorParallelSize: .*tp=3 does not divide"):
        plan(_spec(overrides={"tensorParallelSize": 3}))


def test_fixed_cache_memory_is_used_as_the_budget():
    result = plan(_spec(serving={"maxModelLen": 4096, "maxConcurrency": 8}), kv_cache_memory_bytes=2 * 2**30)
    assert result.prediction.budget_bytes == 2 * 2**30
    # 8 state slots and the null one, and (prefix caching on by default) 4 checkpoint slots, half of max_num_seqs.
    assert result.layout.token_capacity == (2 * 2**30 - (9 + 4) * 51_511_296) // (16 * 32_768) * 16 - 16


def test_gpu_from_node_labels_and_from_memory_only():
    spec = _spec(gpu={"memoryMiB": 81_920})
    assert plan(spec).gpu.memory_mib == 81_920
    assert plan(_spec(gpu={"maxPerReplica": 1}), gpu_spec("NVIDIA-B200")).gpu.name == "b200"
    with pytest.raises(PlanError, match="no GPU to plan for"):
        plan(_spec(gpu={"maxPerReplica": 1}))


def test_model_from_configmap_or_inline_config():
    config = copy.deepcopy(catalog_entry("qwen3.5-0.8b").config)
    spec = _spec("my-finetune", serving={"maxModelLen": 4096, "maxConcurrency": 16})
    with pytest.raises(UnknownModelError, match="unknown model 'my-finetune'"):
        plan(spec)
    assert plan(spec, model_config=config).geometry.num_parameters() == 752_393_024
    ref = parse_hybridmodel({"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel", "metadata": {"name": "t"},
                             "spec": {"model": {"name": "x", "configMapRef": {"name": "cfg"},
                                                "source": {"uri": "hf://a/b"}},
                                      "serving": {"maxModelLen": 4096, "maxConcurrency": 16},
                                      "gpu": {"product": "l4"}}})
    with pytest.raises(PlanError, match="configMapRef 'cfg' must be read before planning"):
        plan(ref)


def test_max_model_len_beyond_the_model_is_rejected():
    with pytest.raises(PlanError, match="exceeds Qwen3.5-4B's max_position_embeddings 262144"):
        plan(_spec(serving={"maxModelLen": 524_288, "maxConcurrency": 1}))


# ---- the commands ----------------------------------------------------------------------------------------------------
def test_plan_command_prints_the_comparison_table(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    for text in ("Qwen3.5-4B", "--gpu-memory-utilization", "hybridkv dual pool", "vLLM 0.20, none mode",
                 "vLLM 0.33, align mode", "ideal bound", "state pool", "token pool", "why"):
        assert text in out


def test_plan_command_json_from_flags(capsys):
    assert main(["plan", "--model", "Qwen/Qwen3.5-9B", "--gpu", "h100", "--max-model-len", "4096",
                 "--max-concurrency", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "Qwen3.5-9B" and data["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"
    assert data["token_capacity"] >= 64 * 4096


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "gpt-2", "--gpu", "h200", "--max-model-len", "10", "--max-concurrency", "1"],
         "unknown model 'gpt-2'"),
        (["plan", "--gpu", "tpu-v5"], "unknown GPU 'tpu-v5'"),
        (["plan", "--gpu-memory-utilization", "1.2"], "must be in \\(0, 1\\]"),
        (["plan", "--tp", "3"], "does not divide"),
        (["plan", "--reserve-margin", "lots"], "reserve margin must be a number"),
        (["plan", str(Path(__file__).parents[1] / "examples" / "finetune-inline-config.yaml"), "--model-config",
          "none.json"],
         "carries its config inline .spec.model.config. and --model-config gives another"),
        (["plan", "--kv-cache-memory", "1Mi", "--max-gpus", "1"],
         "a fixed cache budget of 1.00 MiB per rank .--kv-cache-memory. holds 0 tokens beside 256 state slots at "
         "tp=1 .* or leave it out to plan from the GPU's memory$"),
        (["plan", "--reserve-margin", "nan"], "reserve margin must be a number in \\[0, 10\\], got NaN"),
        (["simulate", "--requests", "0"], "number of requests must be in \\[1, "),
        (["plan", "--kv-cache-memory", "-5"], "cache memory must be a positive number"),
        (["plan", "--kv-cache-memory", "100Ti"], "a fixed cache budget of 102,400.00 GiB per rank does not fit"),
        (["plan", "--gpu", "h200", "--gpu-memory-mib", "50000"], "--gpu and --gpu-memory-mib both name the GPU"),
        (["plan", "--tp", "2", "--max-gpus", "1"], "--tp 2 needs 2 GPUs but --max-gpus allows 1"),
        (["simulate", "--trace", "t.jsonl", "--requests", "10"], "--trace replays its own requests"),
        (["plan", "--max-preemption-rate", "0.1"], "--max-preemption-rate applies to a workload"),
        (["plan", "--max-num-batched-tokens", "0"], "max_num_batched_tokens must be in"),
    ],
)
def test_plan_command_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(message, err)


def test_plan_command_malformed_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: hybridkv.io/v1alpha1\nspec: [\n")
    assert main(["plan", str(bad)]) == 2
    assert "not valid YAML at line" in capsys.readouterr().err


def test_simulate_command_replays_each_allocator(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    assert main(["simulate", "--model", "qwen3.5-0.8b", "--gpu", "l4", "--max-model-len", "2048",
                 "--max-concurrency", "32", "--requests", "60", "--seed", "3", "--write-trace", str(trace),
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["results"]) == set(ALLOCATOR_KEYS)
    for result in data["results"].values():
        assert result["completed"] + result["refused"] == 60
        assert result["peak_concurrency"] <= 32
    assert len(trace.read_text().splitlines()) == 60
    assert main(["simulate", "--model", "qwen3.5-0.8b", "--gpu", "l4", "--max-model-len", "2048",
                 "--max-concurrency", "32", "--trace", str(trace)]) == 0
    assert "replay of the trace" in capsys.readouterr().out


def test_plan_command_with_a_config_file_and_a_gpu_known_by_memory(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"text_config": catalog_entry("qwen3.5-2b").config, "model_type": "qwen3_5"}))
    assert main(["plan", "--model", "acme/finetune-2b", "--model-config", str(config), "--gpu-memory-mib", "49152",
                 "--max-model-len", "16384", "--max-concurrency", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "acme/finetune-2b" and data["gpu"]["memory_mib"] == 49152
    assert data["weights_bytes"] == 2 * catalog_geometry("qwen3.5-2b").num_parameters()


def test_weights_that_fit_but_leave_no_room_for_the_reserve_say_so():
    with pytest.raises(PlanError, match="needs 16.7 GiB of text-model weights and .* GiB of reserve and safety margin"):
        plan(_spec("qwen3.5-9b", gpu={"memoryMiB": 19_000, "maxPerReplica": 1},
                   serving={"maxModelLen": 4096, "maxConcurrency": 4}))


# ---- the fp8 KV cache ------------------------------------------------------------------------------------------------
def _plan_json(capsys, *flags) -> dict:
    assert main(["plan", "--model", "qwen3.5-9b", "--gpu", "h200", "--max-model-len", "32768",
                 "--max-concurrency", "64", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_with_an_fp8_kv_cache_holds_twice_the_tokens_on_the_same_gpus(capsys):
    auto, fp8 = _plan_json(capsys), _plan_json(capsys, "--kv-cache-dtype", "fp8")
    assert (auto["kv_cache_dtype"], auto["kv_dtype"]) == ("auto", "bfloat16")
    assert (fp8["kv_cache_dtype"], fp8["kv_dtype"]) == ("fp8", "float8_e4m3fn")
    assert fp8["bytes_per_token"] * 2 == auto["bytes_per_token"]
    same = ("tensor_parallel_size", "gpu_memory_utilization", "budget_bytes", "state_pool_bytes")
    assert [fp8[key] for key in same] == [auto[key] for key in same]
    assert 2 * auto["token_blocks"] <= fp8["token_blocks"] <= 2 * auto["token_blocks"] + 3
    assert any(reason.startswith("KV cache float8_e4m3fn (serving.kvCacheDtype fp8): 16,384 B per token against "
                                 "32,768 B in bfloat16") for reason in fp8["reasons"])
    # vLLM's columns for the same memory count fp8 pages too.
    assert fp8["allocators"]["ideal"]["token_capacity"] > 1.9 * auto["allocators"]["ideal"]["token_capacity"]


def test_plan_refuses_a_kv_cache_dtype_it_does_not_serve(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--kv-cache-dtype", "fp8_e5m2"])
    assert exit_info.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'" in capsys.readouterr().err
    with pytest.raises(SpecError, match="spec.serving.kvCacheDtype must be one of auto, fp8, got 'int8'"):
        _spec(serving={"maxModelLen": 8192, "maxConcurrency": 8, "kvCacheDtype": "int8"})


def test_the_byte_model_counts_an_fp8_kv_cache_at_one_byte_per_element():
    geometry = catalog_geometry("qwen3.5-4b")
    auto = byte_model(geometry, kv_dtype=kv_cache_dtype("auto", geometry.dtype))
    fp8 = byte_model(geometry, kv_dtype=kv_cache_dtype("fp8", geometry.dtype))
    assert (auto.bytes_per_token, fp8.bytes_per_token) == (32_768, 16_384)
    assert fp8.pool_shapes.kv_dtype == "float8_e4m3fn" and fp8.bytes_per_request == auto.bytes_per_request
    with pytest.raises(GeometryError, match="kv cache dtype must be one of auto, fp8, got 'int4'"):
        kv_cache_dtype("int4", geometry.dtype)


def test_prefix_caching_takes_its_checkpoint_pool_out_of_the_token_pool_and_says_so():
    from hybridkv.sizing.report import render_plan
    from hybridkv.sizing.spec import parse_hybridmodel as parse

    def planned(prefix):
        serving = {"maxModelLen": 8192, "maxConcurrency": 64, **({"prefixCaching": prefix} if prefix else {})}
        return plan(parse({"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel", "metadata": {"name": "p"},
                           "spec": {"model": {"name": "qwen3.5-4b"}, "serving": serving,
                                    "gpu": {"product": "NVIDIA-H200"}}}, require_source=False))

    off, on = planned({"enabled": False}), planned({"enabled": True})
    assert (off.layout.checkpoint_slots, on.layout.checkpoint_slots) == (0, 32)  # half of 64
    assert planned(None).layout == on.layout  # on by default
    per_request = on.prediction.rank_bytes.bytes_per_request
    assert on.layout.checkpoint_pool_bytes == 32 * per_request
    block_bytes = 16 * on.prediction.rank_bytes.bytes_per_token
    assert on.prediction.budget_bytes == off.prediction.budget_bytes  # same GPUs and utilization: only the split moves
    blocks_and_null = (on.prediction.budget_bytes - on.layout.state_pool_bytes - 32 * per_request) // block_bytes
    assert on.layout.token_blocks == blocks_and_null - 1 < off.layout.token_blocks
    figures = on.to_dict()
    assert (figures["checkpoint_slots"], figures["checkpoint_pool_bytes"]) == (32, 32 * per_request)
    assert figures["checkpoint_attention_tokens"] == 32 * per_request // on.prediction.rank_bytes.bytes_per_token
    assert any(r.startswith("prefix caching: 32 GDN state checkpoint slots (the default: 50% of max_num_seqs 64")
               for r in on.reasons)
    assert "checkpoints 32 slots" in render_plan(on) and "--prefix-checkpoint-slots 32" in render_plan(on)
    assert "checkpoints" not in render_plan(off).split("dual pool")[1].split("allocators")[0]
    given = planned({"enabled": True, "checkpointSlots": 5, "checkpointIntervalTokens": 0})
    assert given.layout.checkpoint_slots == 5 and given.checkpoint_interval_tokens == 0
    assert any("set by serving.prefixCaching.checkpointSlots" in r for r in given.reasons)


def _chat_spec(history="messages", concurrency=64, prefix=None, turns=4):
    serving = {"maxModelLen": 8192, "maxConcurrency": concurrency,
               "workload": {"promptTokens": {"mean": 256}, "outputTokens": {"mean": 256},
                            "conversations": {"systemPromptTokens": 2048, "turns": turns, "history": history}},
               "prefixCaching": prefix or {"enabled": True}}
    return parse_hybridmodel({"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel", "metadata": {"name": "c"},
                              "spec": {"model": {"name": "qwen3.5-4b"}, "serving": serving,
                                       "gpu": {"product": "NVIDIA-H200"}}}, require_source=False)


def test_the_checkpoint_pool_is_sized_by_replaying_the_workloads_chats():
    from hybridkv.sizing.prefix import PrefixCacheModel, replay_prefix
    from hybridkv.sizing.allocators import DUAL_POOL, pool_model
    from hybridkv.sizing.workload import (
        CHECKPOINT_SIZING_FRACTION,
        conversation_requests,
        size_checkpoint_slots,
    )

    spec = _chat_spec(concurrency=32)
    workload = spec.serving.workload
    rank = byte_model(catalog_geometry("qwen3.5-4b"))
    sizing = size_checkpoint_slots(workload, rank, 8192, 32, 16, 2048)
    top = max(slots for slots, _ in sizing.tried)
    assert top == 4 * 32 and sizing.slots == sizing.chosen and sizing.replayed_conversations == 32
    goal = CHECKPOINT_SIZING_FRACTION * dict(sizing.tried)[top]
    # The fewest slots tried that reach the goal, every smaller count tried falling short of it.
    assert sizing.hit_fraction >= goal
    assert all(hit < goal for slots, hit in sizing.tried if slots < sizing.chosen)
    # Its hit fraction is the replay's own, on a pool whose tokens never run out.
    requests = conversation_requests(workload, 8192, 32)
    tokens = sum(r.total_tokens for r in requests)
    budget = tokens * 2 * rank.bytes_per_token + (33 + sizing.slots) * rank.bytes_per_request
    pool = pool_model(DUAL_POOL, rank, budget, 32, 16, sizing.slots)
    again = replay_prefix(PrefixCacheModel(pool, 16, 0, sizing.slots, 2048), requests, 8192)
    assert again.hit_fraction == pytest.approx(sizing.hit_fraction) and again.preemptions == 0

    planned = plan(spec)
    assert planned.layout.checkpoint_slots == sizing.slots
    assert any(f"prefix caching: {sizing.slots} GDN state checkpoint slots (sized from serving.workload."
               f"conversations: replaying 32 chats at once, {sizing.slots} slots hit" in r for r in planned.reasons)
    assert planned.requirement == "workload" and planned.workload["completed"] == planned.workload["requests"]


def test_chats_that_send_messages_need_more_checkpoints_than_chats_that_send_tokens():
    """A re-rendered turn resumes from its previous prompt's end, kept while it runs; a token turn from its reply's."""
    messages, tokens = plan(_chat_spec("messages")), plan(_chat_spec("tokens"))
    assert messages.layout.checkpoint_slots > tokens.layout.checkpoint_slots
    assert messages.layout.checkpoint_slots > 64  # more than one per chat: the default (half) would be too few


def test_more_chats_than_the_replay_holds_scale_the_slots_found():
    from hybridkv.sizing.workload import SIZING_CONVERSATIONS, size_checkpoint_slots

    workload = _chat_spec(concurrency=200).serving.workload
    rank = byte_model(catalog_geometry("qwen3.5-4b"))
    sizing = size_checkpoint_slots(workload, rank, 8192, 200, 16, 2048)
    assert sizing.replayed_conversations == SIZING_CONVERSATIONS < 200
    assert sizing.slots == -(-sizing.chosen * 200 // SIZING_CONVERSATIONS)
    assert "scaled to 200 chats" in " ".join(plan(_chat_spec(concurrency=200)).reasons)


def test_given_checkpoint_slots_win_over_the_chats():
    planned = plan(_chat_spec(prefix={"enabled": True, "checkpointSlots": 7}))
    assert planned.layout.checkpoint_slots == 7
    assert any("set by serving.prefixCaching.checkpointSlots" in r for r in planned.reasons)
    assert not any("sized from" in r for r in planned.reasons)


def test_chats_feed_the_length_replay_with_their_whole_prompts():
    from hybridkv.sizing.workload import workload_requests

    workload = _chat_spec(turns=3).serving.workload
    requests = workload_requests(workload, 8192, 64)
    assert len(requests) >= 256 and all(r.arrival_step == 0 and r.total_tokens <= 8192 for r in requests)
    assert min(r.prompt_tokens for r in requests) > 2048  # the system prompt and a message, at least
    assert sum(r.prompt_tokens for r in requests) / len(requests) > 2048 + 256


def test_plan_and_simulate_take_chats_from_flags(capsys):
    args = ["--model", "qwen3.5-4b", "--gpu", "h200", "--max-model-len", "8192", "--max-concurrency", "16",
            "--mean-prompt-tokens", "128", "--mean-output-tokens", "128", "--conversation-turns", "3",
            "--system-prompt-tokens", "1024", "--conversation-history", "tokens", "--prefix-caching"]
    assert main(["plan", *args, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    reasons, sizing = planned["reasons"], planned["checkpoint_sizing"]
    assert sizing["slots"] == planned["checkpoint_slots"] == sizing["replayed_slots"]
    assert sizing["replayed_conversations"] == 16
    assert {"slots": sizing["replayed_slots"], "hit_fraction": sizing["hit_fraction"]} in sizing["tried"]
    assert main(["plan", *args]) == 0
    ladder = f"sized by replaying 16 chats, prompt tokens hit at the slots tried: {sizing['tried'][0]['slots']}: "
    assert ladder in capsys.readouterr().out
    assert any("sized from serving.workload.conversations: replaying 16 chats" in r for r in reasons)
    assert main(["simulate", *args]) == 0
    out = capsys.readouterr().out
    assert "prefix-caching replay of the serving.workload's 16 chats, seed 0" in out
    assert "the history sent as tokens" in out
    assert main(["simulate", *args, "--seed", "4"]) == 0
    assert "16 chats, seed 4" in capsys.readouterr().out
    assert main(["plan", *args[:-5], "--conversation-turns", "3", "--prefix-caching"]) == 2
    assert "chats need both --conversation-turns and --system-prompt-tokens" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen3.5-4b", "--conversation-turns", "3", "--system-prompt-tokens", "9"]) == 2
    assert "give those (not --workload-trace)" in capsys.readouterr().err


@pytest.mark.parametrize("conversations,message", [
    ({"turns": 4}, "spec.serving.workload.conversations.systemPromptTokens is required"),
    ({"systemPromptTokens": 100, "turns": 65}, r"spec.serving.workload.conversations.turns = 65 is outside \[1, 64\]"),
    ({"systemPromptTokens": 100, "turns": 2, "history": "text"},
     "spec.serving.workload.conversations.history must be one of messages, tokens"),
    ({"systemPromptTokens": 8000, "turns": 2},
     r"the system prompt \(8000\) and a mean turn \(256 \+ 256 tokens\) add up to more than serving.maxModelLen 8192"),
    ({"systemPromptTokens": 100, "turns": 2, "users": 3}, "conversations has unknown field"),
])
def test_bad_conversations_are_named(conversations, message):
    serving = {"maxModelLen": 8192, "maxConcurrency": 8,
               "workload": {"promptTokens": {"mean": 256}, "outputTokens": {"mean": 256},
                            "conversations": conversations}}
    with pytest.raises(SpecError, match=message):
        parse_hybridmodel({"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel", "metadata": {"name": "c"},
                           "spec": {"model": {"name": "qwen3.5-4b"}, "serving": serving}}, require_source=False)


def test_chats_that_share_no_whole_block_say_so_and_take_the_fewest_slots():
    serving = {"maxModelLen": 8192, "maxConcurrency": 8, "prefixCaching": {"enabled": True},
               "workload": {"promptTokens": {"mean": 200}, "outputTokens": {"mean": 50},
                            "conversations": {"systemPromptTokens": 8, "turns": 1}}}
    planned = plan(parse_hybridmodel({"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel",
                                      "metadata": {"name": "c"}, "spec": {"model": {"name": "qwen3.5-4b"},
                                                                          "serving": serving,
                                                                          "gpu": {"product": "NVIDIA-H200"}}},
                                     require_source=False))
    sizing = planned.checkpoint_sizing
    assert sizing["best_hit_fraction"] == 0 and sizing["slots"] == min(step["slots"] for step in sizing["tried"])
    assert any("no prompt shares a whole 16-token block with another" in r for r in planned.reasons)
