"""A tensor-parallel worker that dies or stops is detected: the engine raises WorkerFailedError instead of hanging in a
collective, and the gRPC server turns liveness and readiness NOT_SERVING (CPU, gloo, tp=2). Also the gloo twins of
the GPU tests' shutdown and time-limit checks (`tp_checks.py`)."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import torch
from engine_fixtures import make_engine, tiny_checkpoint  # noqa: F401 - pytest fixture
from tp_checks import TimeLimitExceeded, assert_clean_shutdown, time_limit

from hybridkv.api.client import LIVENESS_SERVICE, READINESS_SERVICE, GenerationClient
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.execution.workers import WorkerFailedError

# Upper bound on waiting for the server to notice a dead worker (its idle engine loop checks every 50 ms).
HEALTH_POLL_LIMIT_S = 30.0
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
# close() stops each worker within WORKER_STOP_TIMEOUT_S (10 s) before terminating it; a clean one takes well under 1 s.
CLEAN_SHUTDOWN_BOUND_S = 5.0


def test_a_killed_worker_fails_the_next_step_instead_of_hanging(tiny_checkpoint):  # noqa: F811
    engine = make_engine(tiny_checkpoint, tensor_parallel_size=2)
    worker = engine.executor.worker_processes[0]
    engine.add_request("before", [1, 2, 3], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    # Killed while a decode step is launched and its ids not yet read (the steps overlap).
    engine.add_request("during", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine._launched is not None
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerFailedError, match="rank 1 .*SIGKILL"):
        engine.step()
    with pytest.raises(WorkerFailedError, match="rank 1"):
        engine.stats()
    engine.close()
    assert not torch.distributed.is_initialized()


def test_the_server_reports_not_serving_when_a_worker_dies(tiny_checkpoint):  # noqa: F811
    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.serving.server import BackgroundServer, ServerConfig

    engine_config = EngineConfig(model=tiny_checkpoint, tensor_parallel_size=2, device="cpu", dtype="float32",
                                 max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=4 * 1024**2)
    server = BackgroundServer(engine_config, ServerConfig(host="127.0.0.1", port=0, metrics_port=0)).start().load()
    try:
        with GenerationClient(server.target) as client:
            assert client.check_health(READINESS_SERVICE) == "SERVING"
            assert client.get_capacity()["tensor_parallel_size"] == 2
            responses = list(client.generate([1, 2, 3], max_tokens=3, temperature=0.0, ignore_eos=True))
            assert responses[-1].finished
            os.kill(server.server.engine.worker_pids[0], signal.SIGKILL)
            deadline_s = time.monotonic() + HEALTH_POLL_LIMIT_S
            while client.check_health(READINESS_SERVICE) == "SERVING" and time.monotonic() < deadline_s:
                time.sleep(0.05)
            assert client.check_health(READINESS_SERVICE) == "NOT_SERVING"
            assert client.check_health(LIVENESS_SERVICE) == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as failed:
                list(client.generate([1, 2, 3], max_tokens=3))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "rank 1" in failed.value.details()
    finally:
        server.close()


def test_a_stuck_worker_fails_the_step_at_the_collective_timeout(tiny_checkpoint, monkeypatch):  # noqa: F811
    import hybridkv.sidecar.execution.workers as workers

    monkeypatch.setattr(workers, "COLLECTIVE_TIMEOUT_S", 3.0)  # rank 0's side of every collective
    engine = make_engine(tiny_checkpoint, tensor_parallel_size=2)
    worker = engine.executor.worker_processes[0]
    engine.add_request("stuck", [1, 2, 3], GREEDY)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        with pytest.raises(WorkerFailedError, match="rank 0 failed in a collective step: .*[Tt]imed out"):
            engine.step()
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        engine.close()
    assert not torch.distributed.is_initialized()


def test_close_in_the_middle_of_overlapped_steps_shuts_down_cleanly(tiny_checkpoint):  # noqa: F811
    engine = make_engine(tiny_checkpoint, tensor_parallel_size=2)
    engine.add_request("running", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine._launched is not None  # a step is on the device, its ids unread
    assert assert_clean_shutdown(engine, CLEAN_SHUTDOWN_BOUND_S) < CLEAN_SHUTDOWN_BOUND_S


def test_the_time_limit_ends_a_test_waiting_on_a_stopped_worker(tiny_checkpoint):  # noqa: F811
    engine = make_engine(tiny_checkpoint, tensor_parallel_size=2)
    worker = engine.executor.worker_processes[0]
    os.kill(worker.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(TimeLimitExceeded, match="reading the pools ran past its 2 s limit"):
            with time_limit(2, "reading the pools"):
                engine.executor.pools()  # would wait SETUP_TIMEOUT_S for the stopped worker's reply
        assert time.monotonic() - started < 10
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        engine.close()
    assert not torch.distributed.is_initialized()
