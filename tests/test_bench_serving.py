"""bench/serving.py: its workload generators, its metric arithmetic against hand-computed values, its OpenAI HTTP
target against a small fake SSE server, and one CPU run end to end against `hybridkv serve` on a tiny checkpoint."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from engine_fixtures import tiny_checkpoint  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "serving.py")
serving = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = serving  # dataclasses look their module up while the file executes
_spec.loader.exec_module(serving)


# ---------------------------------------------------------------------------------------------------------- workloads


def test_default_flags_are_the_reference_workload():
    args = serving.build_parser().parse_args(["--target", "grpc://localhost:50051"])
    assert (args.seed, args.requests, args.workload) == (3, 512, "random")
    assert (args.prompt_mu, args.prompt_sigma, args.prompt_min, args.prompt_max) == (6.0, 0.9, 16, 4000)
    assert (args.output_min, args.output_max) == (32, 256)


def test_random_workload_draws_lengths_then_ids_from_one_seeded_generator():
    workload = serving.random_workload(512, serving.Lengths(), 248320, seed=3)
    rng = random.Random(3)
    for conversation in workload:
        prompt_tokens = min(4000, max(16, int(rng.lognormvariate(6.0, 0.9))))
        output_tokens = rng.randint(32, 256)
        ids = tuple(rng.randrange(248320) for _ in range(prompt_tokens))
        assert conversation.prefix_ids == ()
        assert conversation.turns == (serving.Turn(ids, output_tokens),)
    prompt_lengths = [len(conversation.turns[0].message_ids) for conversation in workload]
    assert 300 <= statistics.median(prompt_lengths) <= 500 and 500 <= statistics.fmean(prompt_lengths) <= 700
    assert serving.random_workload(512, serving.Lengths(), 248320, seed=3) == workload
    assert serving.random_workload(512, serving.Lengths(), 248320, seed=4) != workload


def test_equal_min_and_max_give_fixed_lengths():
    lengths = serving.Lengths(prompt_min=32, prompt_max=32, output_min=48, output_max=48)
    workload = serving.random_workload(20, lengths, 512, seed=0)
    assert {(len(c.turns[0].message_ids), c.turns[0].output_tokens) for c in workload} == {(32, 48)}
    assert all(0 <= token < 512 for c in workload for token in c.turns[0].message_ids)


def test_chat_conversations_share_one_system_prompt_and_need_their_whole_history():
    lengths = serving.Lengths(prompt_min=5, prompt_max=9, output_min=3, output_max=6)
    workload = serving.chat_workload(12, 3, 40, lengths, 512, seed=7)
    assert len(workload) == 4 and all(len(conversation.turns) == 3 for conversation in workload)
    assert len({conversation.prefix_ids for conversation in workload}) == 1 and len(workload[0].prefix_ids) == 40
    first = workload[0]
    assert first.tokens_needed() == 40 + sum(len(turn.message_ids) + turn.output_tokens for turn in first.turns)
    assert serving.chat_workload(12, 3, 40, lengths, 512, seed=7) == workload
    with pytest.raises(serving.BenchError, match="multiple of --turns"):
        serving.chat_workload(10, 3, 40, lengths, 512, seed=7)


def test_document_requests_ask_one_of_the_shared_documents():
    workload = serving.document_workload(30, 3, 100, serving.Lengths(prompt_min=8, prompt_max=8), 512, seed=1)
    documents = {conversation.prefix_ids for conversation in workload}
    assert len(documents) == 3 and all(len(document) == 100 for document in documents)
    assert all(len(conversation.turns[0].message_ids) == 8 for conversation in workload)


def test_trace_lines_give_ids_or_seeded_lengths_and_arrival_times(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_ids": [5, 6, 7], "output_tokens": 4, "arrival_s": 0}\n\n'
                     '{"prompt_tokens": 10, "output_tokens": 2, "arrival_s": 0.5}\n'
                     '{"prompt_tokens": 3, "output_tokens": 1, "arrival_s": 0.5}\n')
    workload = serving.read_trace(trace, 100, 512, seed=3)
    assert [conversation.turns[0].message_ids[:3] for conversation in workload][0] == (5, 6, 7)
    assert [len(conversation.turns[0].message_ids) for conversation in workload] == [3, 10, 3]
    assert [conversation.turns[0].output_tokens for conversation in workload] == [4, 2, 1]
    assert [conversation.arrival_s for conversation in workload] == [0, 0.5, 0.5]
    assert serving.read_trace(trace, 100, 512, seed=3) == workload
    assert len(serving.read_trace(trace, 2, 512, seed=3)) == 2


@pytest.mark.parametrize(("line", "message"), [
    ("not json", r"trace.jsonl:2: not JSON"),
    ('{"prompt_ids": [1], "output_tokens": 2, "extra": 1}', r"unknown keys \['extra'\]"),
    ('{"prompt_ids": [600], "output_tokens": 2}', r"token ids in \[0, 511\]"),
    ('{"prompt_tokens": 4}', "'output_tokens' is missing"),
    ('{"prompt_tokens": 4, "prompt_ids": [1], "output_tokens": 1}', "exactly one of"),
    ('{"prompt_tokens": 4, "output_tokens": 0}', r"'output_tokens' must be an integer in \[1,"),
    ('{"prompt_tokens": 4, "output_tokens": 1, "arrival_s": 0.1}', "not below the previous line's"),
])
def test_a_bad_trace_line_is_named_with_what_is_wrong(tmp_path, line, message):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_tokens": 4, "output_tokens": 1, "arrival_s": 1.0}\n' + line + "\n")
    with pytest.raises(serving.BenchError, match=message):
        serving.read_trace(trace, 100, 512, seed=3)


def test_poisson_arrivals_are_seeded_and_keep_the_rate():
    arrivals = serving.poisson_arrivals(4000, 8.0, seed=3)
    assert arrivals == serving.poisson_arrivals(4000, 8.0, seed=3)
    assert all(later > earlier for earlier, later in zip(arrivals, arrivals[1:]))
    assert arrivals[-1] / len(arrivals) == pytest.approx(1 / 8.0, rel=0.05)


# ------------------------------------------------------------------------------------------------------------ metrics


def _record(prompt_tokens: int, chunks: list[tuple[float, int]], done_s: float, sent_s: float = 0.0,
            asked: int | None = None, error: str | None = None):
    record = serving.RequestRecord(prompt_tokens, asked or sum(tokens for _, tokens in chunks), sent_s)
    for now_s, tokens in chunks:
        record.add_chunk(now_s, tokens)
    record.done_s, record.error = done_s, error
    return record


def test_nearest_rank_percentiles():
    values = list(range(1, 11))
    assert [serving.percentile(values, q) for q in (0.5, 0.9, 0.99)] == [5, 9, 10]
    assert serving.percentile([3.0], 0.99) == 3.0
    assert serving.distribution([0.001, 0.003]) == {"p50": 1.0, "p90": 3.0, "p99": 3.0, "mean": 2.0}


def test_one_request_gives_ttft_tpot_and_spreads_a_multi_token_message_over_its_gap():
    record = _record(100, [(1.0, 1), (1.5, 1), (2.5, 2)], done_s=2.6)
    assert record.output_tokens == 4
    assert record.ttft_s == 1.0
    assert record.tpot_s == pytest.approx(0.5)  # (2.5 - 1.0) / (4 - 1)
    assert record.itl_s() == pytest.approx([0.5, 0.5, 0.5])


def test_summary_throughput_goodput_and_failures_from_hand_computed_records():
    records = [
        _record(100, [(0.2, 1), (0.3, 1), (0.4, 1)], done_s=0.4),  # TTFT 200 ms, TPOT 100 ms
        _record(300, [(1.1, 1), (1.2, 1)], done_s=1.2, sent_s=0.1),  # TTFT 1000 ms, TPOT 100 ms
        _record(50, [], done_s=0.5, asked=8, error="RESOURCE_EXHAUSTED: queue full"),
    ]
    summary = serving.summarize(records, wall_s=2.0, slo=serving.Slo(ttft_ms=500, tpot_ms=150))
    assert (summary["requests"], summary["completed"], summary["failed"]) == (3, 2, 1)
    assert summary["errors"] == ["RESOURCE_EXHAUSTED: queue full"]
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (400, 5)
    assert summary["requests_per_s"] == 1.0
    assert summary["total_tokens_per_s"] == 202.5 and summary["output_tokens_per_s"] == 2.5
    assert summary["ttft_ms"]["p50"] == pytest.approx(200) and summary["ttft_ms"]["p99"] == pytest.approx(1000)
    assert summary["tpot_ms"]["p50"] == pytest.approx(100)
    assert summary["e2e_ms"]["p50"] == pytest.approx(400) and summary["e2e_ms"]["p90"] == pytest.approx(1100)
    assert summary["mean_in_flight"] == pytest.approx((0.4 + 1.1) / 2.0)
    assert summary["goodput"]["requests_met"] == 1 and summary["goodput"]["requests_per_s"] == 0.5
    assert summary["goodput"]["fraction_met"] == pytest.approx(1 / 3)
    assert serving.summarize(records, 2.0, serving.Slo())["goodput"] is None
    rows = serving.request_rows(records)
    assert [(row["sent_s"], row["prompt_tokens"], row["output_tokens"]) for row in rows] == [
        (0.0, 100, 3), (0.0, 50, 0), (0.1, 300, 2)]
    assert rows[0]["ttft_ms"] == pytest.approx(200) and rows[0]["e2e_ms"] == pytest.approx(400)
    assert rows[1]["ttft_ms"] is None and rows[1]["error"] == "RESOURCE_EXHAUSTED: queue full"


def test_stall_check_names_the_worst_request_against_its_length_bucket():
    records = [_record(16, [(0.1, 1)], 0.1), _record(20, [(0.1, 1)], 0.1), _record(31, [(0.5, 1)], 0.5),
               _record(32, [(0.3, 1)], 0.3), _record(40, [(0.2, 1)], 0.2)]
    stall = serving.first_shape_stall(records)
    assert stall["worst_ratio"] == pytest.approx(5.0)  # 0.5 s against the 16..31 bucket's median 0.1 s
    assert stall["prompt_tokens"] == 31 and stall["bucket_tokens"] == [16, 31]
    assert stall["bucket_median_ttft_ms"] == pytest.approx(100)
    assert stall["requests_over_limit"] == 1 and not stall["passed"]
    assert serving.first_shape_stall(records[3:])["passed"]  # 0.3 / median(0.3, 0.2) = 1.2


@pytest.mark.parametrize("closed_loop, concurrency, verdict", [
    (True, 1, "first-shape stall check FAILED"), (True, 4, "queueing included"), (False, None, "queueing included")])
def test_stall_verdict_is_given_one_request_at_a_time_only(closed_loop, concurrency, verdict):
    # With requests in flight together a TTFT waits for the others' steps: the spread is reported, not judged.
    records = [_record(16, [(0.1, 1)], 0.1), _record(20, [(0.1, 1)], 0.1), _record(31, [(0.5, 1)], 0.5)]
    phase = {"name": "phase", "summary": serving.summarize(records, 2.0, serving.Slo()), "bound": None,
             "ratios_to_bound": None, "closed_loop": closed_loop, "concurrency": concurrency}
    [line] = [note for note in serving.format_notes(phase) if "its bucket" in note]
    assert verdict in line and "5.00x the median of its bucket" in line
    assert ("FAILED" in line) == (concurrency == 1)


def test_sum_of_parts_bound_and_ratios_from_hand_computed_values():
    records = [_record(1000, [(0.5 + 0.02 * step, 1) for step in range(11)], done_s=0.7) for _ in range(2)]
    parts = serving.Parts(1000.0, ((1.0, 10.0),), "flags")
    bound = serving.sum_of_parts_bound(records, parts, decode_batch=2)
    assert bound["prefill_s"] == 2.0 and bound["decode_steps"] == 10.0  # (10 + 10) / 2
    assert bound["bound_s"] == pytest.approx(2.1)
    assert bound["output_tokens_per_s"] == pytest.approx(22 / 2.1)
    assert bound["ttft_ms"]["p50"] == pytest.approx(1000) and bound["tpot_ms"]["p99"] == pytest.approx(10)
    assert bound["e2e_ms"]["p50"] == pytest.approx(1100)
    summary = serving.summarize(records, wall_s=4.2, slo=serving.Slo())
    ratios = serving.ratios_to_bound(summary, bound)
    assert ratios["total_tokens_per_s"] == pytest.approx(0.5)
    assert ratios["ttft_ms"]["p50"] == pytest.approx(0.5) and ratios["tpot_ms"]["p50"] == pytest.approx(2.0)


def test_parts_from_a_throughput_result_interpolate_the_step_time_and_flags_override(tmp_path):
    result = ROOT / "bench" / "results" / "throughput-2026-11-29.json"
    rows = json.loads(result.read_text())["engine"]["rows"]
    parts = serving.load_parts(result, None, None)
    assert parts.prefill_tokens_per_s == max(row["prefill_tokens_per_s"] for row in rows)
    step = {row["batch"]: row["decode_ms_per_step"] for row in rows}
    assert parts.decode_step_ms(16) == pytest.approx(step[16])
    assert parts.decode_step_ms(40) == pytest.approx(step[16] + (step[64] - step[16]) / 2)
    assert parts.decode_step_ms(1000) == pytest.approx(step[256])
    overridden = serving.load_parts(result, 50_000, 5.7)
    assert overridden.prefill_tokens_per_s == 50_000 and overridden.decode_step_ms(64) == 5.7
    assert serving.load_parts(None, None, None) is None
    with pytest.raises(serving.BenchError, match="go together"):
        serving.load_parts(None, 50_000, None)
    (tmp_path / "bad.json").write_text('{"engine": {}}')
    with pytest.raises(serving.BenchError, match="not a bench/throughput.py result"):
        serving.load_parts(tmp_path / "bad.json", None, None)


@pytest.mark.parametrize(("argv", "message"), [
    (["--target", "ftp://host:1"], "--target must be grpc://"),
    (["--target", "grpc://h:1", "--concurrency", "4", "--request-rate", "2"], "not both"),
    (["--target", "grpc://h:1", "--compare-in-process"], "needs --serve-args"),
    (["--target", "grpc://h:1", "--workload", "trace"], "needs --trace FILE"),
    (["--target", "grpc://h:1", "--requests", "0"], r"--requests must be in \[1, 100000\]"),
    (["--serve-args", "--model m --port 5"], "leave out --port"),
    (["--target", "grpc://h:1", "--api", "chat"], "--api chat needs an http(s):// target"),
    (["--serve-args", "--model m --http-port 5", "--api", "chat"], "leave out --http-port with --api chat"),
    (["--serve-args", "--model m", "--server-pid", "1"], "--server-pid goes with --target"),
    (["--target", "grpc://h:1", "--server-log", "server.log"], "--server-log goes with --serve-args"),
    (["--serve-args", "--model m", "--server-log", "/nonexistent-folder/server.log"],
     "--server-log /nonexistent-folder/server.log: No such file or directory"),
    (["--target", "grpc://h:1", "--server-pid", "0"], "--server-pid 0: no such process"),
    (["--target", "grpc://h:1", "--server-pid", str(2**22 + 1)], f"--server-pid {2**22 + 1}: no such process"),
])
def test_bad_settings_exit_2_with_one_line(capsys, tmp_path, argv, message):
    assert serving.main([*argv, "--out", str(tmp_path / "out.json")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message.replace("\\", "") in error.replace("\\", "")
    assert not (tmp_path / "out.json").exists()


# ---------------------------------------------------------------------------------------------------- the HTTP target


async def _fake_completions_server(with_token_ids: bool):
    """An OpenAI-style completions server streaming one event per token (or two tokens per text event)."""
    from aiohttp import web

    bodies = []

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        if len(body["prompt"]) > 100:
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        produced = 0
        while produced < body["max_tokens"]:
            step = 1 if with_token_ids else min(2, body["max_tokens"] - produced)
            choice = {"index": 0, "text": "ab"[:step], "finish_reason": None}
            if with_token_ids:
                choice["token_ids"] = [produced + 1]
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            produced += step
            await asyncio.sleep(0.002)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": produced}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", bodies


async def test_http_target_streams_token_ids_and_carries_a_chat_conversation():
    runner, url, bodies = await _fake_completions_server(with_token_ids=True)
    try:
        lengths = serving.Lengths(prompt_min=4, prompt_max=6, output_min=3, output_max=5)
        workload = serving.chat_workload(4, 2, 10, lengths, 512, seed=3)
        async with serving.make_target(url, None, 30.0) as target:
            assert (await target.describe())["name"] == "fake-model"
            records, wall_s = await serving.run_phase(target, workload, serving.Phase("concurrency 2", 2))
    finally:
        await runner.cleanup()
    assert wall_s > 0 and len(records) == 4 and all(record.error is None for record in records)
    assert [record.output_tokens for record in records] == [record.asked_output_tokens for record in records]
    assert all(body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0 and body["model"] == "fake-model"
               for body in bodies)
    # The second turn's prompt is the first turn's prompt, the fake server's reply (1, 2, ...) and the new message.
    for conversation in workload:
        first = [body for body in bodies if body["prompt"] == [*conversation.prefix_ids,
                                                               *conversation.turns[0].message_ids]]
        reply = list(range(1, conversation.turns[0].output_tokens + 1))
        second_prompt = [*first[0]["prompt"], *reply, *conversation.turns[1].message_ids]
        assert any(body["prompt"] == second_prompt for body in bodies)


async def test_http_target_without_token_ids_counts_by_usage_and_reports_http_errors():
    runner, url, _bodies = await _fake_completions_server(with_token_ids=False)
    workload = [serving.Conversation((), (serving.Turn(tuple(range(8)), 5),)),
                serving.Conversation((), (serving.Turn(tuple(range(200)), 5),))]
    try:
        async with serving.make_target(url, "named-model", 30.0) as target:
            records, _wall_s = await serving.run_phase(target, workload, serving.Phase("rate", None, (0.0, 0.01)))
    finally:
        await runner.cleanup()
    by_prompt = {record.prompt_tokens: record for record in records}
    assert by_prompt[8].error is None and by_prompt[8].output_tokens == 5
    assert by_prompt[200].error.startswith("HTTP 400: ") and "prompt too long" in by_prompt[200].error


# ----------------------------------------------------------------------------------------- one run against a server


def _run_against_serve(serve_args: str, flags: list[str], out: Path) -> subprocess.CompletedProcess:
    """bench/serving.py starting `hybridkv serve SERVE_ARGS` itself, one torch thread; fails the test if it fails."""
    result = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "serving.py"), "--serve-args", serve_args, *flags,
         "--out", str(out)], capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _expected_chat_prompt_tokens(workload) -> int:
    total = 0
    for conversation in workload:
        history = len(conversation.prefix_ids)
        for turn in conversation.turns:
            history += len(turn.message_ids)
            total += history
            history += turn.output_tokens
    return total


def test_a_cpu_run_against_hybridkv_serve_reports_every_figure(tiny_checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "serving.json"
    flags = ["--workload", "chat", "--requests", "6", "--turns", "2", "--system-tokens", "24", "--prompt-min", "4",
             "--prompt-max", "40", "--output-min", "3", "--output-max", "8", "--concurrency", "1,3", "--seed", "5"]
    serve_args = (f"--model {tiny_checkpoint} --device cpu --max-num-seqs 4 --max-model-len 256 "
                  "--kv-cache-memory 8Mi --max-num-batched-tokens 256")
    result = _run_against_serve(serve_args, [*flags, "--compare-in-process", "--prefill-tok-s", "20000",
                                             "--decode-step-ms", "4", "--slo-ttft-ms", "10000", "--slo-tpot-ms",
                                             "10000"], out)
    assert "| concurrency 3 | 6/6 |" in result.stdout and "sum of parts" in result.stdout
    report = json.loads(out.read_text())
    assert report["model_info"]["vocab_size"] == 512 and report["requests"] == 6
    lengths = serving.Lengths(prompt_min=4, prompt_max=40, output_min=3, output_max=8)
    workload = serving.chat_workload(6, 2, 24, lengths, 512, seed=5)
    asked_output = sum(turn.output_tokens for conversation in workload for turn in conversation.turns)
    assert [phase["name"] for phase in report["phases"]] == ["concurrency 1", "concurrency 3"]
    for phase in report["phases"]:
        for figures in (phase["summary"], phase["in_process"]):
            assert (figures["completed"], figures["failed"], figures["outputs_not_as_asked"]) == (6, 0, 0)
            assert figures["output_tokens"] == asked_output
            # Each second turn's prompt holds the first turn's reply: the server's own tokens came back.
            assert figures["prompt_tokens"] == _expected_chat_prompt_tokens(workload)
            assert figures["requests_per_s"] * figures["wall_s"] == pytest.approx(6)
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                quantiles = figures[key]
                assert 0 < quantiles["p50"] <= quantiles["p90"] <= quantiles["p99"], key
            assert figures["ttft_ms"]["p99"] <= figures["e2e_ms"]["p99"]
            assert figures["goodput"]["requests_met"] == 6
            assert figures["first_shape_stall"]["worst_ratio"] >= 1.0
        bound = phase["bound"]
        assert bound["decode_batch"] == (1 if phase["concurrency"] == 1 else 3)
        assert bound["bound_s"] == pytest.approx(phase["summary"]["prompt_tokens"] / 20000
                                                 + (asked_output - 6) / bound["decode_batch"] * 0.004)
        ratios = phase["ratios_to_bound"]
        assert ratios["total_tokens_per_s"] == pytest.approx(
            phase["summary"]["total_tokens_per_s"] / bound["total_tokens_per_s"])
        # /proc counts CPU in 10 ms ticks: the event loop's share of a few tiny requests may round to none.
        assert phase["server_cpu_us_per_output_token"] > 0
        assert 0 <= phase["event_loop_cpu_us_per_output_token"] <= phase["server_cpu_us_per_output_token"]
        assert 0 < phase["client_cpu_fraction"] <= os.cpu_count()
        overhead = phase["in_process_overhead"]
        assert math.isfinite(overhead["itl_p50_fraction"]) and math.isfinite(overhead["cpu_per_output_token_fraction"])
        # The server's engine stepped through the phase; on CPU its results are ready when read, so it never waits.
        steps = phase["engine_steps"]
        assert steps["steps"]["decode"] > 0 and sum(steps["steps"].values()) >= asked_output // 3
        assert steps["mean_step_ms"] > 0 and steps["device_wait_fraction"] == 0.0
        # On CPU every step runs eagerly, so nothing is held back, and nothing is compiled (no Triton kernels run).
        assert steps["prefill_held_steps"] == 0 and steps["jit_compiles"] == 0
        # The server's histograms saw the phase's requests (the warm-up's are before the phase), and the engine's
        # share of a request's time lies inside what the client measured end to end.
        times = phase["request_times"]
        assert times["requests"] == 6
        assert 0 < times["queue_ms"] + times["prefill_ms"] + times["decode_ms"] <= times["e2e_ms"]
        assert times["e2e_ms"] <= phase["summary"]["e2e_ms"]["p99"]
        # The first token's time: the engine's part inside the server's, the server's inside the client's.
        assert 0 < times["queue_ms"] + times["prefill_ms"] <= times["server_ttft_ms"] <= (
            phase["summary"]["ttft_ms"]["mean"])
        # Request by request, in the order sent: the same tokens and TTFTs the summary is made of.
        rows = phase["request_rows"]
        assert len(rows) == 6 and rows[0]["sent_s"] == 0.0
        assert [row["sent_s"] for row in rows] == sorted(row["sent_s"] for row in rows)
        assert sum(row["prompt_tokens"] for row in rows) == phase["summary"]["prompt_tokens"]
        assert sum(row["output_tokens"] for row in rows) == asked_output
        assert max(row["ttft_ms"] for row in rows) == pytest.approx(phase["summary"]["ttft_ms"]["p99"])
        assert all(0 < row["server_ttft_ms"] <= row["ttft_ms"] <= row["e2e_ms"] and row["error"] is None
                   for row in rows)
    assert "ms queued in the engine" in result.stdout and "between client and front door" in result.stdout


def test_the_unbounded_prefix_cache_hits_whole_cached_blocks_short_of_the_last_prompt_token():
    cache = serving.UnboundedPrefixCache(block_size=4)
    system = list(range(100, 110))  # two whole blocks and two tokens
    assert cache.lookup(system + [1, 2, 3]) == 0  # nothing cached yet
    cache.add(system + [1, 2, 3])  # its first token came: blocks of 4, 8 and 12 tokens are cached
    assert cache.lookup(system + [1, 9, 9, 9]) == 8  # the third block differs at its last token
    assert cache.lookup(system + [1, 2]) == 8  # 12 would leave no prompt token to compute
    assert cache.lookup(system + [1, 2, 3, 4]) == 12
    assert cache.lookup([7] + system) == 0  # a block's key stands for every token before it
    cache.add_reply(system + [1, 2, 3], [4, 5, 6, 7, 8])  # the reply's last token left out by the caller
    assert cache.lookup(system + [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 16
    assert cache.hit_tokens == 0  # lookups count once their request ran
    cache.count(8)
    cache.count(16)
    assert cache.hit_tokens == 24


def test_a_rendered_prompts_unbounded_cache_replays_the_phase_on_the_servers_ids():
    """The chat endpoint's histories are messages: lookups and additions are replayed in their order on the ids
    the server gives for each history, and a lookup whose request failed is not counted."""

    class Rendering:
        calls = 0

        async def prompt_ids(self, history):
            Rendering.calls += 1
            return [len(message["content"]) for message in history for _ in range(4)]  # 4 ids per message

    first = [{"role": "user", "content": "ab"}]
    second = [*first, {"role": "assistant", "content": "xyz"}, {"role": "user", "content": "c"}]
    cache = serving.RenderedPrefixCache(block_size=4)
    cache.count(cache.lookup(first))
    cache.add(first)
    cache.add_reply(first, [9, 9, 9, 9])
    cache.count(cache.lookup(second))  # shares first's 4 ids (a block), not the reply's ids
    cache.lookup(second)  # a request that failed: not counted
    assert cache.hit_tokens == 0
    asyncio.run(cache.settle(Rendering()))
    assert cache.hit_tokens == 4 and Rendering.calls == 2  # each distinct history tokenized once


def test_a_rendered_prompts_unbounded_cache_is_none_when_the_server_cannot_tokenize():
    class NoTokenize:
        async def prompt_ids(self, history):
            raise serving.TargetError("POST /tokenize: HTTP 404: not found")

    cache = serving.RenderedPrefixCache(block_size=4)
    cache.count(cache.lookup([{"role": "user", "content": "ab"}]))
    asyncio.run(cache.settle(NoTokenize()))
    assert cache.hit_tokens is None


def test_a_cpu_chat_run_with_prefix_caching_reports_hits_per_checkpoint_kind(tiny_checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "serving.json"
    flags = ["--workload", "chat", "--requests", "6", "--turns", "3", "--system-tokens", "40", "--prompt-min", "4",
             "--prompt-max", "20", "--output-min", "17", "--output-max", "20", "--concurrency", "2", "--seed", "5"]
    serve_args = (f"--model {tiny_checkpoint} --device cpu --max-num-seqs 4 --max-model-len 256 "
                  "--kv-cache-memory 8Mi --enable-prefix-caching --prefix-checkpoint-slots 8")
    log = tmp_path / "server.log"
    result = _run_against_serve(serve_args, [*flags, "--server-log", str(log)], out)
    assert "gRPC on 127.0.0.1" in log.read_text()  # the server's own log, kept where asked
    assert json.loads(out.read_text())["server_warnings"] == serving.logged_warnings(log.read_text().splitlines())
    prefix = json.loads(out.read_text())["phases"][0]["prefix_cache"]
    assert 0 < prefix["hit_tokens"] < prefix["queried_tokens"]
    assert prefix["hit_tokens_by_kind"]["output_end"] > 0  # later turns resume where the reply ended
    assert sum(prefix["hit_tokens_by_kind"].values()) == prefix["hit_tokens"]
    # Later turns resume their history in both; the server's count may pass the client's model a little (it shares
    # a prompt's blocks while the prompt is still prefilling, before the client has seen its first token).
    assert prefix["unbounded_hit_tokens"] > 0
    assert prefix["fraction_of_unbounded"] == prefix["hit_tokens"] / prefix["unbounded_hit_tokens"]
    assert "prefix cache hit" in result.stdout and "an unbounded cache" in result.stdout
    # Each response's usage says what its request took from the cache: together, the server's hits over the phase
    # (one admission each: the run is too small to preempt).
    reported = json.loads(out.read_text())["phases"][0]["reported_cache"]
    assert reported["requests"] == 6 and reported["cached_tokens"] == prefix["hit_tokens"]
    assert 0 < reported["requests_with_a_hit"] < 6 and reported["ttft_ms_with_a_hit"]["p50"] > 0
    assert "the responses report" in result.stdout
    # The last responses carry the server's own time to first token: the client's holds it, request by request.
    gap = json.loads(out.read_text())["phases"][0]["front_door_gap_ms"]
    assert 0 <= gap["p50"] <= gap["p99"] and "the client's TTFT less the server's own" in result.stdout


def test_the_servers_warnings_are_read_from_its_log_at_most_a_bounded_many():
    log = ["2026-12-07 14:45:20,100 INFO hybridkv.sidecar.serving.server: gRPC on 127.0.0.1:5\n",
           "2026-12-07 14:45:21,931 WARNING hybridkv.sidecar.execution.warmup: Triton compiled _norm_kernel after "
           "ready: a shape the warm-up did not cover (key " + "x" * 2000 + ")\n",
           "  a traceback's line: 2026-12-07 14:45:21,931 WARNING in the middle\n",
           "2026-12-07 14:45:22,000 ERROR hybridkv.sidecar.serving.server: a request failed\n"]
    warnings = serving.logged_warnings(log)
    assert [line[24:31] for line in warnings] == ["WARNING", "ERROR h"]
    assert warnings[0].startswith("2026-12-07 14:45:21,931 WARNING") and warnings[0].endswith(" ...")
    assert len(warnings[0]) == serving.SERVER_WARNING_CHARS + 4
    many = serving.logged_warnings([log[3]] * (serving.SERVER_WARNINGS_KEPT + 3))
    assert len(many) == serving.SERVER_WARNINGS_KEPT + 1 and many[-1] == "... and 3 more"
    assert serving.logged_warnings(log[:1]) == []


def test_chat_messages_spell_the_workloads_ids_as_words():
    words = serving.MESSAGE_WORDS
    assert serving.words_of([0, 1, len(words) + 2]) == " ".join([words[0], words[1], words[2]])
    # At 2 tokens per word, 6 ids are 3 words: the message keeps the workload's token length.
    assert serving.words_of([0, 1, 2, 3, 4, 5], tokens_per_word=2.0) == " ".join(words[:3])
    assert serving.words_of([], 2.0) == "" and serving.words_of([4], 3.0) == words[4]
    target = serving.make_target("http://h:1", "m", 1.0, "chat")
    history = target.open_history((0, 1))
    target.add_message(history, (2,))
    target.add_reply(history, [7, 8], "the reply")
    assert history == [{"role": "system", "content": f"{words[0]} {words[1]}"}, {"role": "user", "content": words[2]},
                       {"role": "assistant", "content": "the reply"}]
    assert target.open_history(()) == [] and not target.sees_prompt_ids


def test_a_cpu_chat_run_through_the_chat_endpoint_re_renders_the_history(tiny_checkpoint, tmp_path):  # noqa: F811
    """Each turn sends the conversation as messages; the server renders them through the checkpoint's chat template,
    so a later turn shares the earlier prompt (and its prompt-end checkpoint) but not the reply's generated ids."""
    out = tmp_path / "serving.json"
    flags = ["--api", "chat", "--workload", "chat", "--requests", "6", "--turns", "3", "--system-tokens", "40",
             "--prompt-min", "4", "--prompt-max", "12", "--output-min", "6", "--output-max", "10",
             "--concurrency", "2", "--seed", "5"]
    serve_args = (f"--model {tiny_checkpoint} --device cpu --max-num-seqs 4 --max-model-len 1024 "
                  "--kv-cache-memory 16Mi --enable-prefix-caching --prefix-checkpoint-slots 32")
    result = _run_against_serve(serve_args, flags, out)
    run = json.loads(out.read_text())
    phase = run["phases"][0]
    assert phase["summary"]["completed"] == 6
    # The tiny tokenizer splits the message words into several tokens each; the calibration measured how many, and
    # the messages were scaled so that the prompts are the workload's lengths plus the template's own tokens.
    assert run["calibration"]["tokens_per_word"] > 1.5
    lengths = serving.Lengths(prompt_min=4, prompt_max=12, output_min=6, output_max=10)
    workload = serving.chat_workload(6, 3, 40, lengths, serving.CHAT_WORDS, seed=5)
    expected = _expected_chat_prompt_tokens(workload)
    assert expected < phase["summary"]["prompt_tokens"] < 2 * expected
    prefix = phase["prefix_cache"]
    assert prefix["hit_tokens_by_kind"]["prompt_end"] > 0
    # The client replays its lookups on the server's /tokenize ids: the bound a re-rendering client allows.
    assert 0 < prefix["unbounded_hit_tokens"] and prefix["fraction_of_unbounded"] == (
        prefix["hit_tokens"] / prefix["unbounded_hit_tokens"])
    # The OpenAI usage's prompt_tokens_details.cached_tokens, request by request, add up to the server's hits.
    assert phase["reported_cache"]["cached_tokens"] == prefix["hit_tokens"] > 0


def test_engine_steps_of_a_phase_from_the_servers_counters():
    before = dict.fromkeys(("steps_decode", "steps_mixed", "steps_prefill", "step_seconds", "device_wait_seconds",
                            "prefill_held_steps", "jit_compiles"), 0.0)
    before["jit_compiles"] = 2.0  # compiled before the phase: not the phase's
    after = {"steps_decode": 90.0, "steps_mixed": 8.0, "steps_prefill": 2.0, "step_seconds": 2.5,
             "device_wait_seconds": 2.0, "prefill_held_steps": 30.0, "tpot_held_steps": 12.0, "jit_compiles": 3.0}
    assert serving.engine_steps_summary(before, after) == {
        "steps": {"decode": 90, "mixed": 8, "prefill": 2}, "mean_step_ms": pytest.approx(25.0),
        "device_wait_fraction": pytest.approx(0.8), "prefill_held_steps": 30, "tpot_held_steps": 12,
        "jit_compiles": 1}
    assert serving.engine_steps_summary(after, after) is None  # a server without the counters, or an idle phase


def test_request_times_of_a_phase_are_the_means_of_the_histograms_over_it():
    names = [f"{name}_{part}" for name in serving.REQUEST_TIMES for part in ("sum", "count")]
    before = dict.fromkeys(names, 0.0) | {"e2e_request_latency_sum": 5.0, "e2e_request_latency_count": 2.0}
    after = dict(before) | {"e2e_request_latency_sum": 6.0, "e2e_request_latency_count": 6.0,
                            "request_queue_time_sum": 0.2, "request_queue_time_count": 4.0,
                            "request_prefill_time_sum": 0.4, "request_prefill_time_count": 4.0,
                            "request_decode_time_sum": 0.3, "request_decode_time_count": 4.0,
                            "time_to_first_token_sum": 0.9, "time_to_first_token_count": 5.0}
    assert serving.request_times_summary(before, after) == {
        "requests": 4, "e2e_ms": pytest.approx(250.0), "queue_ms": pytest.approx(50.0),
        "prefill_ms": pytest.approx(100.0), "decode_ms": pytest.approx(75.0), "server_ttft_ms": pytest.approx(180.0)}
    # A server without the time-to-first-token histogram still has the engine's split.
    assert serving.request_times_summary(before, after | {"time_to_first_token_count": 0.0})["server_ttft_ms"] is None
    assert serving.request_times_summary(after, after) is None  # no request finished in the phase
