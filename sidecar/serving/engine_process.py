"""The engine in a process of its own, and the client through which the gRPC server drives it.

The server's asyncio loop spends Python time on every streamed message; with the engine stepping in a thread of the
same process, that time holds the GIL the step needs. Here the engine process (rank 0 when tensor-parallel; it spawns
the other ranks as before) loops: apply the commands that arrived, step, send that step's outputs and a stats snapshot
as one message. The server process keeps only tokenizing, validating and streaming; the two share nothing but two pipes.
A dead engine process shows as end-of-file on the pipe (or its exit), a dead server process the same way to the engine.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable

from hybridkv.errors import UserError

log = logging.getLogger(__name__)

# Seconds the idle engine process waits for a command before it checks its workers and its parent again.
IDLE_WAIT_S = 0.05
# Commands applied before each step at most, so a burst of arrivals cannot hold up the requests already running.
MAX_COMMANDS_PER_STEP = 4096
# Longest wait on close for the engine process to free its last requests and exit before it is terminated.
STOP_TIMEOUT_S = 30.0
# Longest wait for a terminated engine process, or for the reader thread after the process has gone.
TERMINATE_TIMEOUT_S = 5.0


class EngineProcessError(RuntimeError):
    """The engine process failed or exited; it serves nothing more."""


class EngineClient:
    """Starts the engine process and talks to it; the callbacks run on the client's reader thread.

    `on_outputs(outputs)` gets each step's RequestOutputs, `on_rejected(request_id, reason)` an add that the engine
    refused, `on_failure(error)` the end of the engine process (not called once `close()` has begun).
    """

    def __init__(self, config, on_outputs: Callable[[list], None], on_rejected: Callable[[str, str], None],
                 on_failure: Callable[[BaseException], None]):
        self.config = config
        self.capacity: dict | None = None
        self.model_info: dict | None = None
        self.worker_pids: tuple[int, ...] = ()
        self.stats = None
        self.error: BaseException | None = None
        self._on_outputs = on_outputs
        self._on_rejected = on_rejected
        self._on_failure = on_failure
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: multiprocessing.connection.Connection | None = None
        self._events: multiprocessing.connection.Connection | None = None
        self._lock = threading.Lock()
        self._capacity_waiters: dict[int, concurrent.futures.Future] = {}
        self._next_token = itertools.count()
        self._reader: threading.Thread | None = None
        self._closing = False
        self._stopped = False

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def exitcode(self) -> int | None:
        return None if self._process is None else self._process.exitcode

    def start(self) -> None:
        """Spawns the engine process and blocks until it has built the engine and measured its pools.

        Raises UserError for a configuration the engine refused, EngineProcessError for any other failure.
        """
        context = multiprocessing.get_context("spawn")
        command_read, self._commands = context.Pipe(duplex=False)
        self._events, event_write = context.Pipe(duplex=False)
        self._process = context.Process(target=_engine_main, name="hybridkv-engine",
                                        args=(self.config, command_read, event_write, os.getpid()))
        self._process.start()
        # Only the engine process may hold its ends, so that its exit reads as end-of-file here.
        command_read.close()
        event_write.close()
        atexit.register(self.close)
        message = self._receive()
        if message is None or message[0] != "ready":
            self.close()
            raise self._error_from(message)
        _, self.capacity, self.model_info, self.stats, self.worker_pids = message
        self._reader = threading.Thread(target=self._read_loop, name="hybridkv-engine-reader", daemon=True)
        self._reader.start()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        """Queues a request validated by the caller; a refusal the engine alone can see comes to `on_rejected`."""
        self._send(("add", request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        """Asks the engine to free the request's slot and blocks at its next step; a gone engine holds nothing."""
        try:
            self._send(("abort", request_id))
        except EngineProcessError:
            pass

    def request_capacity(self) -> concurrent.futures.Future:
        """The engine's CapacityReport as a dict, taken after it has applied every command sent before this one."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        token = next(self._next_token)
        with self._lock:
            self._capacity_waiters[token] = future
        try:
            self._send(("capacity", token))
        except EngineProcessError as exc:
            with self._lock:
                self._capacity_waiters.pop(token, None)
            future.set_exception(exc)
        return future

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Asks the engine process to finish its aborted requests and exit; terminates it if it does not in time."""
        atexit.unregister(self.close)
        if self._process is None or self._closing:
            return
        self._closing = True
        try:
            self._send(("stop",))
        except EngineProcessError:
            pass
        self._process.join(timeout_s)
        if self._process.exitcode is None:
            log.warning("the engine process did not stop within %.0f s; terminating it", timeout_s)
            self._process.terminate()
            self._process.join(TERMINATE_TIMEOUT_S)
            if self._process.exitcode is None:
                self._process.kill()
                self._process.join()
        if self._reader is not None:
            self._reader.join(TERMINATE_TIMEOUT_S)
        self._commands.close()
        self._events.close()

    # ---------------------------------------------------------------------------------------------- internals

    def _send(self, command: tuple) -> None:
        with self._lock:
            if self.error is not None:
                raise self.error
            try:
                self._commands.send(command)
            except (OSError, ValueError) as exc:  # ValueError: the pipe is closed on this side
                raise EngineProcessError(f"the engine process is gone: {exc}") from exc

    def _receive(self):
        """The engine process's next message, or None once it has exited or closed its end of the pipe."""
        try:
            ready = multiprocessing.connection.wait([self._events, self._process.sentinel])
            return self._events.recv() if self._events in ready else None
        except (EOFError, OSError, ValueError):  # ValueError, OSError: `close()` closed the pipe meanwhile
            return None

    def _read_loop(self) -> None:
        while True:
            message = self._receive()
            kind = None if message is None else message[0]
            if kind == "step":
                _, outputs, self.stats = message
                if outputs:
                    self._on_outputs(outputs)
            elif kind == "stats":
                self.stats = message[1]
            elif kind == "capacity":
                with self._lock:
                    waiter = self._capacity_waiters.pop(message[1], None)
                if waiter is not None:
                    waiter.set_result(message[2])
            elif kind == "rejected":
                self._on_rejected(message[1], message[2])
            elif kind == "stopped":
                self.stats = message[1]
                self._stopped = True
                return
            else:
                self._fail(self._error_from(message))
                return

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.error = error
            waiters, self._capacity_waiters = self._capacity_waiters, {}
        for waiter in waiters.values():
            waiter.set_exception(error)
        if not self._closing:
            log.error("%s", error)
            self._on_failure(error)

    def _error_from(self, message) -> BaseException:
        """The error a `failed` message carries, or one that names how the engine process ended."""
        if message is not None and message[0] == "failed":
            _, type_name, reason, user_error = message
            return UserError(reason) if user_error else EngineProcessError(f"{type_name}: {reason}")
        self._process.join(TERMINATE_TIMEOUT_S)
        code = self._process.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        elif code is not None:
            how = f"exited with code {code}"
        else:
            how = "closed its pipe"
        return EngineProcessError(f"the engine process (pid {self._process.pid}) {how}")


# -------------------------------------------------------------------------------------------- engine process

def _engine_main(config, commands, events, parent_pid: int) -> None:
    """Entry point of the engine process: build the engine, report what it measured, then serve commands."""
    # The server process decides when to stop; Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from hybridkv.sidecar.core.engine import Engine

    try:
        engine = Engine(config)
    except Exception as exc:  # noqa: BLE001 - every start-up failure goes back to the server, which reports it
        _send_failure(events, exc)
        sys.exit(1)
    try:
        worker_pids = tuple(worker.pid for worker in engine.executor.worker_processes) if engine.executor else ()
        events.send(("ready", engine.capacity().to_dict(), engine.model_info(), engine.stats(), worker_pids))
        _serve(engine, commands, events, parent_pid)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.warning("the server process is gone; the engine process stops")
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - any engine failure must end every stream, not hang them
        log.exception("engine step failed; the engine process stops")
        _send_failure(events, exc)
        sys.exit(1)
    finally:
        engine.close()


def _serve(engine, commands, events, parent_pid: int) -> None:
    """Applies commands and steps until told to stop and every request has ended, or the server process is gone."""
    stopping = False
    capacity_tokens: list[int] = []
    last_stats = None
    while True:
        busy = engine.has_unfinished_requests()
        if not busy and stopping:
            events.send(("stopped", engine.stats()))
            return
        if not busy and os.getppid() != parent_pid:
            raise EOFError("the server process exited")
        applied = 0
        while applied < MAX_COMMANDS_PER_STEP and commands.poll(IDLE_WAIT_S if not (busy or applied) else 0):
            stopping |= _apply(engine, commands.recv(), events, capacity_tokens)
            applied += 1
        if engine.has_unfinished_requests():
            outputs = engine.step()
            last_stats = engine.stats()
            events.send(("step", outputs, last_stats))
        else:
            # Also how a dead tensor-parallel worker is noticed between requests.
            stats = engine.stats()
            if stats != last_stats:
                events.send(("stats", stats))
                last_stats = stats
        for token in capacity_tokens:
            events.send(("capacity", token, engine.capacity().to_dict()))
        capacity_tokens.clear()


def _apply(engine, command: tuple, events, capacity_tokens: list[int]) -> bool:
    """Applies one command from the server; True for `stop`."""
    from hybridkv.sidecar.core.sampling import RequestError

    kind = command[0]
    if kind == "add":
        _, request_id, prompt_token_ids, params = command
        try:
            engine.add_request(request_id, prompt_token_ids, params)
        except RequestError as exc:
            events.send(("rejected", request_id, str(exc)))
    elif kind == "abort":
        engine.abort(command[1])
    elif kind == "capacity":
        capacity_tokens.append(command[1])
    elif kind == "stop":
        return True
    else:
        raise EngineProcessError(f"unknown command {kind!r} from the server process")
    return False


def _send_failure(events, exc: BaseException) -> None:
    """Sends the failure as plain strings: an exception object might not unpickle in the server process."""
    try:
        events.send(("failed", type(exc).__name__, str(exc), isinstance(exc, UserError)))
    except OSError:
        log.warning("the server process is gone; it cannot be told: %s", exc)
