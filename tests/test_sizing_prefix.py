"""Prefix caching in the replay: hits per allocator on tiny traces whose figures are derived by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybridkv.sizing import DUAL_POOL, WorkloadError, byte_model, catalog_geometry, pool_model, pool_models
from hybridkv.sizing.prefix import (
    TokenRequest,
    multi_turn_workload,
    parse_token_trace,
    prefix_cache_models,
    read_token_trace,
    replay_prefix_all,
    shared_document_workload,
    write_token_trace,
)

RANK = byte_model(catalog_geometry("qwen3.5-4b"))
HOPPER = (9, 0)  # vLLM 0.33 align mode: 576-token blocks for Qwen3.5-4B
BUDGET = 20 * 2**30
MAX_MODEL_LEN = 32_768


def _replay(requests, checkpoint_slots=8, interval=2048):
    models = prefix_cache_models(pool_models(RANK, BUDGET, 16, compute_capability=HOPPER), RANK, checkpoint_slots,
                                 interval)
    assert set(models) == {"hybridkv", "vllm-0.33-align", "ideal"}  # none mode has no prefix cache
    return replay_prefix_all(models, requests, MAX_MODEL_LEN, check_invariants=True)


def _ids(start, count):
    return tuple(range(start, start + count))


def _hits(results):
    return {key: result.hit_tokens for key, result in results.items()}


def test_a_prompt_shorter_than_an_align_block_never_hits_in_align_mode():
    prompt = _ids(0, 500)
    requests = [TokenRequest(0, prompt, _ids(9000, 4)), TokenRequest(100, prompt, _ids(9100, 4))]
    results = _replay(requests)
    assert results["vllm-0.33-align"].cache_block_tokens == 576
    # dual pool: the checkpoint for the prompt's end (496) at the last 64-token chunk start before it, 448, taken
    # while the prompt runs; ideal: all but the last token
    assert _hits(results) == {"hybridkv": 448, "vllm-0.33-align": 0, "ideal": 499}
    assert results["hybridkv"].hit_tokens_by_kind == {"prompt_end": 448}
    assert results["hybridkv"].prefill_tokens == 500 + (500 - 448)
    assert results["vllm-0.33-align"].unbounded_fraction == 0.0


def test_a_2k_system_prompt_hits_in_the_dual_pool_from_the_second_request():
    system = _ids(0, 2048)
    requests = [TokenRequest(100 * i, system + _ids(10_000 * (i + 1), 100), _ids(5000, 2)) for i in range(3)]
    results = _replay(requests)
    # the checkpoint every 2048 tokens falls on the system prompt's end; align mode hits 3 × 576 of it
    assert _hits(results) == {"hybridkv": 2 * 2048, "vllm-0.33-align": 2 * 1728, "ideal": 2 * 2048}
    assert results["hybridkv"].hit_tokens_by_kind == {"inside_prompt": 4096}
    assert results["hybridkv"].hit_fraction == pytest.approx(4096 / (3 * 2148))
    # without the interval the second request finds the blocks but no checkpoint: it checkpoints where it leaves them
    results = _replay(requests, interval=0)
    assert results["hybridkv"].hit_tokens == 2048


def test_the_next_turn_resumes_from_the_reply_end_checkpoint():
    first = TokenRequest(0, _ids(0, 100), _ids(1000, 50))
    second = TokenRequest(200, first.prompt_ids + first.output_ids + _ids(2000, 30), _ids(3000, 5))
    results = _replay([first, second])
    # 149 tokens computed when the reply ends: the checkpoint at 144, beyond the prompt end at 96
    assert results["hybridkv"].hit_tokens_by_kind == {"output_end": 144}
    assert _hits(results) == {"hybridkv": 144, "vllm-0.33-align": 0, "ideal": 149}


def test_a_re_rendered_turn_resumes_from_the_prompt_end_before_its_tail():
    """A client re-rendering its history: the prompt's last 2 tokens (the template's generation prompt) are not sent
    again, and the reply comes back as other ids. The prompt-end checkpoint sits before the tail (the 129-token
    prompt less 2: 112, taken at the 64-token chunk start 64 while the prompt runs), and no output-end checkpoint
    is taken; the next turn resumes at 64. Without the tail the prompt end is 128, which holds a tail token."""
    first = TokenRequest(0, _ids(0, 127) + (7, 7), _ids(1000, 50), resume_tail_tokens=2)
    second = TokenRequest(200, _ids(0, 127) + _ids(5000, 50) + _ids(2000, 30), _ids(3000, 5), resume_tail_tokens=2)
    results = _replay([first, second])
    assert results["hybridkv"].hit_tokens_by_kind == {"prompt_end": 64}
    assert _hits(results) == {"hybridkv": 64, "vllm-0.33-align": 0, "ideal": 127}
    untailed = _replay([replace(first, resume_tail_tokens=0), replace(second, resume_tail_tokens=0)])
    assert untailed["hybridkv"].hit_tokens == 0


def test_a_running_re_rendered_turn_keeps_its_prompt_end_from_eviction():
    """Two slots: one-off prompts arriving while a re-rendered turn decodes evict every checkpoint but the one it
    keeps (at most half the slots), so its next turn resumes there; without the tail it is evicted."""
    def requests(tail):
        first = TokenRequest(0, _ids(0, 130) + (7, 7)[:tail], _ids(1000, 60), resume_tail_tokens=tail)
        others = [TokenRequest(5 + 5 * i, _ids(10_000 * (i + 1), 130), (1,)) for i in range(6)]
        second = TokenRequest(100, _ids(0, 130) + _ids(5000, 20), (1,), resume_tail_tokens=tail)
        return [first, *others, second]

    assert _replay(requests(2), checkpoint_slots=2)["hybridkv"].hit_tokens_by_kind == {"prompt_end": 128}
    assert _replay(requests(0), checkpoint_slots=2)["hybridkv"].hit_tokens == 0


def test_cache_salt_isolates_tenants():
    prompt = _ids(0, 1210)
    salted = [TokenRequest(0, prompt, (1,), "tenant-a"), TokenRequest(50, prompt, (1,), "tenant-b")]
    assert _hits(_replay(salted)) == {"hybridkv": 0, "vllm-0.33-align": 0, "ideal": 0}
    same = [TokenRequest(0, prompt, (1,), "tenant-a"), TokenRequest(50, prompt, (1,), "tenant-a")]
    assert _hits(_replay(same)) == {"hybridkv": 1152, "vllm-0.33-align": 1152, "ideal": 1209}


def test_the_checkpoint_pool_evicts_least_recently_used():
    a, b = _ids(0, 320), _ids(50_000, 320)
    requests = [TokenRequest(0, a, (1,)), TokenRequest(10, b, (1,)), TokenRequest(20, a + _ids(90_000, 40), (1,))]
    # one slot: b's prompt-end checkpoint evicted a's, so the blocks are cached but nothing resumes
    assert _replay(requests, checkpoint_slots=1)["hybridkv"].hit_tokens == 0
    assert _replay(requests, checkpoint_slots=2)["hybridkv"].hit_tokens == 320


def test_cached_blocks_are_evicted_under_pressure_and_counted():
    # 16 state slots (+1 null), 4 checkpoints and 4 usable token blocks (+1 null)
    budget = (17 + 4) * RANK.bytes_per_request + 5 * 16 * RANK.bytes_per_token
    models = prefix_cache_models({"hybridkv": pool_model(DUAL_POOL, RANK, budget, 16)}, RANK, 4)
    assert models["hybridkv"].pool.pool_units == 4
    # 48-token prompts fill 4 blocks each with the first token: the second evicts the first's cached blocks
    requests = [TokenRequest(0, _ids(0, 48), (1,)), TokenRequest(5, _ids(100, 48), (1,)),
                TokenRequest(10, _ids(0, 48), (1,))]
    result = replay_prefix_all(models, requests, 64, check_invariants=True)["hybridkv"]
    assert result.hit_tokens == 0 and result.completed == 3
    assert result.peak_cached_block_bytes == 3 * 16 * RANK.bytes_per_token
    assert result.peak_checkpoint_bytes == 2 * RANK.bytes_per_request


def test_seeded_workloads_replay_with_invariants():
    chat = multi_turn_workload(7, conversations=4, turns=3, system_prompt_tokens=600, mean_user_tokens=40,
                               mean_output_tokens=30)
    assert chat == multi_turn_workload(7, 4, 3, 600, 40, 30)
    assert len(chat) == 12 and all(r.prompt_ids[:600] == chat[0].prompt_ids[:600] for r in chat)
    docs = shared_document_workload(3, documents=2, questions_per_document=3, document_tokens=700,
                                    mean_question_tokens=20, mean_output_tokens=10)
    assert len(docs) == 6
    results = _replay(chat)
    assert all(r.completed == len(chat) for r in results.values())
    assert 0 < results["vllm-0.33-align"].hit_tokens < results["hybridkv"].hit_tokens <= results["ideal"].hit_tokens
    rerendered = multi_turn_workload(7, 4, 3, 600, 40, 30, rerendered=True)
    by_arrival = sorted(rerendered, key=lambda r: (r.prompt_ids[600:610], r.arrival_step))
    turn, later = by_arrival[0], by_arrival[1]  # two turns of one conversation
    assert turn.resume_tail_tokens == 2 and turn.prompt_ids[-2:] == later.prompt_ids[-2:]
    shared = turn.prompt_tokens - 2
    assert later.prompt_ids[:shared] == turn.prompt_ids[:shared] and later.prompt_ids[shared] != turn.output_ids[0]
    results = _replay(rerendered)
    assert results["hybridkv"].hit_tokens_by_kind.get("output_end", 0) == 0
    assert results["hybridkv"].hit_tokens_by_kind["prompt_end"] > 0
    results = _replay(docs)
    # per document: the second question finds the 43 blocks before the document's end (688 tokens) without a
    # checkpoint and checkpoints at the last 64-token chunk start before that (640) as its prompt runs, so only the
    # third hits; align mode keeps a state page at 576 for both
    assert results["hybridkv"].hit_tokens == 2 * 640
    assert results["vllm-0.33-align"].hit_tokens == 2 * 2 * 576
    assert results["ideal"].hit_tokens >= 2 * 2 * 700


def test_token_trace_round_trip_and_errors(tmp_path):
    requests = [TokenRequest(0, (1, 2, 3), (4,), "t"), TokenRequest(2, (1, 2), (5, 6), resume_tail_tokens=1)]
    path = tmp_path / "trace.jsonl"
    write_token_trace(requests, path)
    assert read_token_trace(path) == requests
    bad = [
        ({"arrival_step": 0, "prompt_ids": [], "output_ids": [1]}, "prompt_ids must be a list of 1 to"),
        ({"arrival_step": 0, "prompt_ids": [-1], "output_ids": [1]}, "token ids are integers"),
        ({"arrival_step": 0, "prompt_ids": [1], "output_ids": [1], "cache_salt": 3}, "cache_salt must be a string"),
        ({"arrival_step": 0, "prompt_tokens": 5, "output_tokens": 1}, "gives prompt_ids and output_ids"),
        ({"arrival_step": 0, "prompt_ids": [1, 2], "output_ids": [1], "resume_tail_tokens": 2},
         r"resume_tail_tokens must be an integer in \[0, 2\)"),
        ({"arrival_step": 0, "prompt_ids": [1, 2], "output_ids": [1], "resume_tail_tokens": True},
         "resume_tail_tokens must be"),
    ]
    for item, message in bad:
        with pytest.raises(WorkloadError, match=message):
            parse_token_trace([json.dumps(item)], "t.jsonl")
    with pytest.raises(WorkloadError, match="t.jsonl line 1 is not JSON"):
        parse_token_trace(["{"], "t.jsonl")


def test_simulate_command_with_prefix_caching_replays_a_token_trace(tmp_path, capsys):
    from hybridkv.cli import main

    trace = tmp_path / "chat.jsonl"
    system = _ids(0, 2048)
    write_token_trace([TokenRequest(40 * i, system + _ids(10_000 * (i + 1), 100), _ids(5000, 8)) for i in range(3)],
                      trace)
    argv = ["simulate", "--prefix-caching", "--trace", str(trace), "--max-concurrency", "8"]
    assert main(argv + ["--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert {key: r["hit_tokens"] for key, r in results.items()} == {
        "hybridkv": 4096, "vllm-0.33-align": 2 * 1728, "ideal": 4096}
    assert results["hybridkv"]["checkpoint_slots"] == 4  # half of max_num_seqs 8
    assert main(argv + ["--prefix-checkpoint-interval", "100"]) == 2
    assert "checkpointIntervalTokens = 100 is not a multiple of the 16-token block" in capsys.readouterr().err
    assert main(argv + ["--prefix-checkpoint-slots", "0"]) == 2
    assert "prefixCaching.checkpointSlots = 0 is outside [1, 65536]" in capsys.readouterr().err
    # Requests longer than the model length replay as nothing: the table says so rather than showing bare zeros.
    assert main(argv + ["--max-model-len", "2100"]) == 0
    assert "3 of 3 requests were refused on arrival (longer than max_model_len 2,100" in capsys.readouterr().out


def test_a_burst_behind_a_new_prefix_resumes_where_the_first_checkpoints_for_the_waiting():
    """Four prompts behind one new 1,000-token prefix arrive together (no interval checkpoint). The first checkpoints
    where the waiting prompts part from it (992, taken at 960, the last 64-token chunk start before it), so the other
    three resume there; the replay admits them after it in the same step, as the engine does a step later."""
    shared = _ids(0, 1000)
    requests = [TokenRequest(0, shared + _ids(10_000 * (i + 1), 50), (1, 2)) for i in range(4)]
    results = _replay(requests, interval=0)
    assert results["hybridkv"].hit_tokens_by_kind == {"inside_prompt": 3 * 960}
    # Sharing less than the wait's worth (500 tokens), each computes the prefix: the second then checkpoints where it
    # leaves the first's blocks (496, at 448) and the last two resume there.
    short = [TokenRequest(0, _ids(0, 500) + _ids(10_000 * (i + 1), 50), (1, 2)) for i in range(4)]
    assert _replay(short, interval=0)["hybridkv"].hit_tokens_by_kind == {"inside_prompt": 2 * 448}


def test_a_documents_checkpoint_used_twice_outlives_one_off_prompts_in_the_replay():
    """Four checkpoint slots. The second question about a document checkpoints where it leaves the first's blocks
    (992, taken at 960); two more questions resume there, which protects it; four one-off prompts' own checkpoints
    then evict each other rather than it, so a fifth question still resumes at 960 (a plain LRU would have lost it)."""
    document = _ids(0, 1000)
    questions = [TokenRequest(100 * i, document + _ids(10_000 * (i + 1), 40), (1,)) for i in range(4)]
    one_offs = [TokenRequest(500 + 100 * i, _ids(100_000 * (i + 1), 300), (1,)) for i in range(4)]
    last = TokenRequest(1000, document + _ids(90_000, 40), (1,))
    result = _replay([*questions, *one_offs, last], checkpoint_slots=4, interval=0)["hybridkv"]
    assert result.hit_tokens_by_kind == {"inside_prompt": 3 * 960}


def test_chats_end_before_a_turn_that_would_not_fit():
    chats = multi_turn_workload(3, conversations=8, turns=6, system_prompt_tokens=300, mean_user_tokens=60,
                                mean_output_tokens=60, user_sigma=1.0, output_sigma=1.0, max_tokens=600)
    assert chats and all(r.total_tokens <= 600 for r in chats)
    unbounded = multi_turn_workload(3, conversations=8, turns=6, system_prompt_tokens=300, mean_user_tokens=60,
                                    mean_output_tokens=60, user_sigma=1.0, output_sigma=1.0)
    assert len(chats) < len(unbounded) and any(r.total_tokens > 600 for r in unbounded)
