"""The engine's own process ends with the sidecar: a killed `hybridkv serve` leaves no engine holding the GPU.

Reads the process tree from Linux /proc, as the sidecar only runs on Linux."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine_fixtures import tiny_checkpoint  # noqa: F401  (fixture)

from hybridkv.api.client import READINESS_SERVICE, GenerationClient
from hybridkv.net import free_loopback_port

STARTUP_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 30.0


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return children


def _running(pid: int) -> bool:
    """False once the process has exited, also while it waits as a zombie for a parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_ready(target: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with GenerationClient(target) as client:
        while time.monotonic() < deadline:
            assert server.poll() is None, f"hybridkv serve exited with {server.returncode}"
            try:
                if client.check_health(READINESS_SERVICE, timeout_s=1.0) == "SERVING":
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.2)
    raise AssertionError(f"hybridkv serve was not ready within {STARTUP_TIMEOUT_S} s")


def _serve(checkpoint: str, folder: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "hybridkv", "serve", "--model", checkpoint, "--device", "cpu",
         "--kv-cache-memory", "16Mi", "--max-num-seqs", "4", "--max-model-len", "256",
         "--port", str(port), "--metrics-port", str(free_loopback_port()), "--http-port", "0", "--host", "127.0.0.1"],
        stdout=open(folder / "serve.log", "w"), stderr=subprocess.STDOUT, cwd=folder,
    )


def test_the_engine_processs_start_up_report_reaches_the_servers_log(tiny_checkpoint, tmp_path):  # noqa: F811
    """The engine process is spawned without the server's logging; it sets up its own at the server's level, so its
    start-up phases (where the time to ready went) are in the log beside the server's lines."""
    port = free_loopback_port()
    server = _serve(tiny_checkpoint, tmp_path, port)
    try:
        _wait_ready(f"127.0.0.1:{port}", server)
    finally:
        server.terminate()
        server.wait(timeout=30)
    log = (tmp_path / "serve.log").read_text()
    assert "INFO hybridkv.sidecar.core.engine: ready in" in log
    assert "memory profiling" in log and "INFO hybridkv.sidecar.serving.frontend: ready:" in log


def test_killing_the_server_ends_its_engine_process(tiny_checkpoint, tmp_path):  # noqa: F811
    port = free_loopback_port()
    server = _serve(tiny_checkpoint, tmp_path, port)
    try:
        _wait_ready(f"127.0.0.1:{port}", server)
        engines = [pid for pid in _children(server.pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1, f"expected one engine process under the server, found {engines}"
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while _running(engines[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(engines[0]), f"engine process {engines[0]} outlived its killed server"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_commands_are_sent_in_order_without_blocking_while_the_pipe_is_full():
    """A pipe holds 64 KiB and the engine reads it only between steps: the writer thread takes the wait, so putting
    200 long-prompt commands (about 3 MB) returns at once although nothing reads the pipe yet; then all arrive, in
    order."""
    import multiprocessing

    from hybridkv.sidecar.serving.engine_process import CommandWriter

    reader, writer_end = multiprocessing.Pipe(duplex=False)
    errors = []
    writer = CommandWriter(writer_end, errors.append, name="test-writer")
    commands = [("add", index, list(range(index, index + 2_000))) for index in range(200)]
    started = time.monotonic()
    for command in commands:
        writer.put(command)
    assert time.monotonic() - started < 1.0
    assert [reader.recv() for _ in commands] == commands
    writer.close(timeout_s=5.0)
    assert errors == []


def test_a_broken_pipe_reaches_the_writers_error_callback_once():
    import multiprocessing

    from hybridkv.sidecar.serving.engine_process import CommandWriter, EngineProcessError

    reader, writer_end = multiprocessing.Pipe(duplex=False)
    reader.close()
    errors = []
    writer = CommandWriter(writer_end, errors.append, name="test-writer")
    writer.put("first")
    writer.put("dropped")
    writer.close(timeout_s=5.0)
    assert len(errors) == 1 and isinstance(errors[0], EngineProcessError) and "gone" in str(errors[0])


def test_a_command_that_cannot_be_sent_fails_the_engine_rather_than_the_writer_silently():
    import multiprocessing
    import threading

    from hybridkv.sidecar.serving.engine_process import CommandWriter

    reader, writer_end = multiprocessing.Pipe(duplex=False)
    errors = []
    writer = CommandWriter(writer_end, errors.append, name="test-writer")
    writer.put(threading.Lock())  # not picklable
    writer.close(timeout_s=5.0)
    assert len(errors) == 1 and "could not be sent" in str(errors[0]) and "TypeError" in str(errors[0])
    reader.close()
