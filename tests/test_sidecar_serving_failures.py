"""The serving path under a careless user and an adversary: each test is a failure the sidecar once had.

A capacity poll whose caller gives up, duplicate ids racing through background tokenizing, a stopped engine, a cache
budget the machine cannot hold, a server that dies under its engine, huge prompts and stop strings, undecodable
messages — and a bounded chaos run of all of them at once, after which the pools hold nothing and health is true.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

pytest.importorskip("torch")

from hybridkv.api import generation_pb2 as pb  # noqa: E402
from hybridkv.api.client import LIVENESS_SERVICE, READINESS_SERVICE, GenerationClient  # noqa: E402
from hybridkv.net import free_loopback_port  # noqa: E402
from serving_fixtures import MAX_NUM_SEQS, engine_config, model_dir, server_config  # noqa: E402,F401 (a fixture)

POLL_LIMIT_S = 30.0
GENERATE_METHOD = "/hybridkv.v1.GenerationService/Generate"








@pytest.fixture(scope="module")
def sidecar(model_dir):
    from hybridkv.sidecar.serving.server import BackgroundServer

    background = BackgroundServer(engine_config(model_dir), server_config(stall_timeout_s=2.0)).start().load()
    yield background
    background.close()


@pytest.fixture
def client(sidecar):
    with GenerationClient(sidecar.target) as generation_client:
        yield generation_client


def _drain_stream(stream) -> pb.GenerateResponse:
    last = None
    for last in stream:
        pass
    return last


def _wait_idle(client: GenerationClient) -> dict:
    deadline_s = time.monotonic() + POLL_LIMIT_S
    while True:
        usage = client.get_capacity()["usage"]
        if (usage["used_state_slots"], usage["used_token_blocks"], usage["running"], usage["waiting"]) == (0, 0, 0, 0):
            return usage
        assert time.monotonic() < deadline_s, f"the pools never emptied: {usage}"
        time.sleep(0.02)


def _wait_health(client: GenerationClient, service: str, state: str, limit_s: float = POLL_LIMIT_S) -> None:
    deadline_s = time.monotonic() + limit_s
    while client.check_health(service) != state:
        assert time.monotonic() < deadline_s, f"{service or 'overall'} health never turned {state}"
        time.sleep(0.05)


def test_capacity_polls_whose_callers_give_up_leave_the_server_working(client):
    busy = [client.generate([1, 2, 3], max_tokens=60, temperature=0.0, ignore_eos=True) for _ in range(MAX_NUM_SEQS)]
    next(busy[0])
    gave_up = 0
    for deadline_ms in range(1, 11):
        try:
            client.get_capacity(timeout_s=deadline_ms / 1000)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            gave_up += 1
    assert gave_up >= 1
    for stream in busy:
        assert _drain_stream(stream).finish_reason == pb.FINISH_REASON_LENGTH
    # Every later call still gets an answer, and health says so truthfully.
    assert _drain_stream(client.generate([4, 5], max_tokens=3, timeout_s=10)).finished
    assert client.get_capacity(timeout_s=10)["state_slots"] == MAX_NUM_SEQS
    assert client.check_health(LIVENESS_SERVICE) == "SERVING"
    _wait_idle(client)


def test_a_duplicate_id_is_refused_while_the_first_call_is_still_tokenizing(sidecar, client, monkeypatch):
    """Two calls with one id: the first holds the id while its prompt is tokenized off the event loop."""
    from hybridkv.sidecar.serving import frontend

    monkeypatch.setattr(frontend, "INLINE_TOKENIZE_MAX_CHARS", 16)
    text = "hello world " * 8
    tokenizer = sidecar.server.tokenizer
    release = threading.Event()
    original = tokenizer.encode

    def held_encode(prompt):
        if prompt == text:
            release.wait(POLL_LIMIT_S)
        return original(prompt)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    try:
        first = client.generate(text, request_id="held", max_tokens=2, timeout_s=POLL_LIMIT_S)
        first_result = ThreadPoolExecutor(max_workers=1).submit(_drain_stream, first)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as caught:
            _drain_stream(client.generate([1, 2], request_id="held", max_tokens=2, timeout_s=5))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already in flight" in caught.value.details()
    finally:
        release.set()
    assert first_result.result(timeout=POLL_LIMIT_S).finish_reason == pb.FINISH_REASON_LENGTH
    assert _drain_stream(client.generate([1, 2], request_id="held", max_tokens=2, timeout_s=5)).finished
    _wait_idle(client)


def test_a_stopped_engine_fails_liveness_and_it_recovers_when_the_engine_resumes(sidecar, client):
    stream = client.generate([1, 2, 3], max_tokens=40, temperature=0.0, ignore_eos=True, timeout_s=POLL_LIMIT_S)
    next(stream)
    os.kill(sidecar.server.engine.pid, signal.SIGSTOP)
    try:
        _wait_health(client, LIVENESS_SERVICE, "NOT_SERVING", limit_s=15)
        assert client.check_health(READINESS_SERVICE) == "NOT_SERVING"
    finally:
        os.kill(sidecar.server.engine.pid, signal.SIGCONT)
    assert _drain_stream(stream).finish_reason == pb.FINISH_REASON_LENGTH
    _wait_health(client, LIVENESS_SERVICE, "SERVING")
    assert client.check_health(READINESS_SERVICE) == "SERVING"
    _wait_idle(client)


def test_a_cache_budget_larger_than_host_memory_is_refused_at_start(model_dir):
    from hybridkv.errors import UserError
    from hybridkv.sidecar.core.engine import Engine

    started = time.monotonic()
    with pytest.raises(UserError, match=r"--kv-cache-memory .* exceeds the .* GiB of host memory available"):
        Engine(engine_config(model_dir, kv_cache_memory_bytes=100 * 2**40))
    assert time.monotonic() - started < 30


def _children(pid: int) -> list[int]:
    """Every thread's children: the engine process is started from a worker thread of the server."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
            children.extend(int(child) for child in handle.read().split())
    return children


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_engine_process_dies_with_a_killed_server(model_dir):
    port = free_loopback_port()
    server = subprocess.Popen(
        [sys.executable, "-P", "-m", "hybridkv", "serve", "--model", str(model_dir), "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--http-port", "0", "--max-num-seqs", "2",
         "--max-model-len", "128", "--kv-cache-memory", "4Mi"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline_s = time.monotonic() + POLL_LIMIT_S
        engine_pids: list[int] = []
        while not engine_pids:
            assert time.monotonic() < deadline_s and server.poll() is None, "the engine process never started"
            engine_pids = [pid for pid in _children(server.pid) if _alive(pid)]
            time.sleep(0.1)
        server.kill()
        server.wait(10)
        deadline_s = time.monotonic() + 10
        while any(_alive(pid) for pid in engine_pids):
            assert time.monotonic() < deadline_s, "the engine process outlived its server"
            time.sleep(0.1)
    finally:
        if server.poll() is None:
            server.kill()


def test_a_huge_prompt_is_refused_from_its_length_without_tokenizing(client):
    huge = "a" * (3 * 1024 * 1024)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        _drain_stream(client.generate(huge, max_tokens=1, timeout_s=POLL_LIMIT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3145728 characters" in caught.value.details() and "max_model_len 256" in caught.value.details()
    assert time.monotonic() - started < 5


def test_an_error_quotes_a_bounded_excerpt_of_the_input(client):
    with pytest.raises(grpc.RpcError) as caught:
        _drain_stream(client.generate([1, 2], stop=["s" * 20_000], max_tokens=2, timeout_s=5))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "20000 characters" in caught.value.details()
    assert len(caught.value.details()) < 400


@pytest.mark.parametrize("payload", [
    pb.GenerateRequest(request_id="fine").SerializeToString() + b"\x12\x03\xff\xfe\xfd",  # text with invalid UTF-8
    pb.GenerateRequest(text="a" * 64).SerializeToString()[:20],  # cut short
], ids=["invalid-utf8", "truncated"])
def test_undecodable_requests_are_invalid_argument_and_log_at_most_a_line(sidecar, payload, caplog):
    with grpc.insecure_channel(sidecar.target) as channel:
        call = channel.unary_stream(GENERATE_METHOD, request_serializer=None, response_deserializer=None)
        with caplog.at_level(logging.WARNING, logger="hybridkv.sidecar.serving.server"):
            for _ in range(20):
                with pytest.raises(grpc.RpcError) as caught:
                    list(call(payload, timeout=5))
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "did not decode" in caught.value.details()
    assert len([r for r in caplog.records if "did not decode" in r.getMessage()]) <= 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_chaos_leaves_the_pools_empty_and_health_true(client, sidecar):
    """Cancels, short deadlines, capacity polls with tiny deadlines and duplicate ids, bounded in count and time."""
    rng = random.Random(11)
    errors: list[str] = []
    deadline_s = time.monotonic() + 60

    def one(index: int) -> None:
        action = rng.choice(["full", "cancel", "deadline", "capacity", "duplicate"])
        try:
            if action == "capacity":
                client.get_capacity(timeout_s=rng.choice([0.001, 0.005, 5.0]))
                return
            stream = client.generate([1 + index % 50, 2, 3], max_tokens=rng.randint(1, 30), ignore_eos=True,
                                     request_id="dup" if action == "duplicate" else "",
                                     timeout_s=rng.uniform(0.01, 0.3) if action == "deadline" else POLL_LIMIT_S)
            if action == "cancel":
                next(stream, None)
                stream.cancel()
                return
            _drain_stream(stream)
        except grpc.RpcError as exc:
            expected = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
            if exc.code() not in expected or (exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                                              and "already in flight" not in exc.details()):
                errors.append(f"{action}: {exc.code()} {exc.details()}")

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(one, index) for index in range(160)]
        for future in futures:
            future.result(timeout=max(1.0, deadline_s - time.monotonic()))
    assert not errors
    _wait_idle(client)
    assert client.check_health(LIVENESS_SERVICE) == "SERVING"
    assert client.check_health(READINESS_SERVICE) == "SERVING"
    assert _drain_stream(client.generate([7, 8], max_tokens=2, timeout_s=10)).finished


def test_a_port_taken_after_the_command_line_checked_it_is_a_user_error(model_dir):
    import socket

    from hybridkv.errors import UserError
    from hybridkv.sidecar.serving.server import BackgroundServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        background = BackgroundServer(engine_config(model_dir), server_config(port=port))
        try:
            with pytest.raises(UserError, match=rf"cannot listen on 127.0.0.1:{port} \(--port\)"):
                background.start()
        finally:
            background.close()


def test_outputs_that_pile_up_are_merged_with_their_logprobs():
    """A busy event loop hands a request several engine outputs at once; they go out as one, losing nothing."""
    from hybridkv.sidecar.core.outputs import RequestOutput, TokenLogprobs
    from hybridkv.sidecar.serving.frontend import merge_outputs

    def output(token_id, finished=False):
        return RequestOutput("r", [token_id], f"<{token_id}>", finished, "length" if finished else None, 3, token_id,
                             logprobs=[TokenLogprobs(logprob=-token_id / 10, top=((token_id, -token_id / 10),))])

    merged = merge_outputs([output(1), output(2), output(3, finished=True)])
    assert merged.new_token_ids == [1, 2, 3] and merged.text_delta == "<1><2><3>"
    assert [entry.top[0][0] for entry in merged.logprobs] == [1, 2, 3]
    assert merged.finished and merged.finish_reason == "length" and merged.completion_tokens == 3
