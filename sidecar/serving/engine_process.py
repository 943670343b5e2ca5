"""The engine in a process of its own, and the client through which the server drives it.

The server's asyncio loop spends Python time on every streamed message; with the engine stepping in a thread of the
same process, that time holds the GIL the step needs. Here the engine process (rank 0 when tensor-parallel; it spawns
the other ranks) loops: apply the commands that arrived, step, send that step's outputs and a stats snapshot as one
message. The two processes share nothing but two pipes, and speak the typed messages of `messages`.

Failure modes the client turns into states rather than hangs:
- the engine process exits or closes its pipe: `on_failure` is called once, every pending query fails;
- a caller gives up on a capacity query: its waiter is dropped, and the late answer is ignored;
- the engine process stops making progress while it has work (stopped, stuck): `stalled_for_s()` says for how long,
  and the server's health turns NOT_SERVING past its limit;
- the server process dies: the engine process (and through it the tensor-parallel workers) notices within
  half a second and exits, even in the middle of loading weights.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable

from hybridkv.errors import UserError
from hybridkv.sidecar import configure_logging
from hybridkv.sidecar.execution.parent_watch import exit_with_parent
from hybridkv.sidecar.serving.messages import (
    AbortRequest,
    AddRequest,
    CapacityAnswer,
    CapacityQuery,
    EngineFailed,
    EngineReady,
    EngineStopped,
    RequestRejected,
    StatsChanged,
    StepDone,
    StopEngine,
    UnknownMessageError,
)

log = logging.getLogger(__name__)

# Seconds the idle engine process waits for a command before it checks its workers again.
IDLE_WAIT_S = 0.05
# Commands applied before each step at most, so a burst of arrivals cannot hold up the requests already running.
MAX_COMMANDS_PER_STEP = 4096
# Longest wait on close for the engine process to free its last requests and exit before it is terminated.
STOP_TIMEOUT_S = 30.0
# Longest wait for a terminated engine process, or for the reader thread after the process has gone.
TERMINATE_TIMEOUT_S = 5.0


class EngineProcessError(RuntimeError):
    """The engine process failed or exited; it serves nothing more."""


_STOP_WRITING = object()


class CommandWriter:
    """Sends commands down a pipe from a thread of its own, in the order they were put: `put` never blocks its caller.

    The engine process reads its commands only between steps, and a pipe holds 64 KiB: a few long prompts fill it,
    after which a send waits for the engine's next step. Sent from the server's event loop, that wait held up every
    stream, every new call and every health check with it (and, under the lock the reader takes, the reader too).
    `on_error(error)` is called once if the pipe fails; commands put after that are dropped."""

    def __init__(self, conn: multiprocessing.connection.Connection, on_error: Callable[[BaseException], None],
                 name: str):
        self._conn = conn
        self._on_error = on_error
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, command) -> None:
        self._queue.put(command)

    def close(self, timeout_s: float) -> None:
        """Returns once the commands put before have been sent (or the pipe failed), or after `timeout_s`."""
        self._queue.put(_STOP_WRITING)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (command := self._queue.get()) is not _STOP_WRITING:
            try:
                self._conn.send(command)
            except (OSError, ValueError) as exc:  # ValueError: the pipe is closed on this side
                self._on_error(EngineProcessError(f"the engine process is gone: {exc}"))
                return
            except Exception as exc:  # noqa: BLE001 - a writer that dies silently would wedge every caller
                self._on_error(EngineProcessError(f"a command could not be sent to the engine process: "
                                                  f"{type(exc).__name__}: {exc}"))
                return


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
        self._writer: CommandWriter | None = None
        self._lock = threading.Lock()
        self._capacity_waiters: dict[int, concurrent.futures.Future] = {}
        self._next_query_id = itertools.count()
        self._reader: threading.Thread | None = None
        self._closing = False
        # Work sent that the engine has not answered for yet, and when the engine last showed progress.
        self._outstanding = 0
        self._last_event_s = time.monotonic()

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
                                        args=(self.config, command_read, event_write, os.getpid(),
                                              logging.getLogger().getEffectiveLevel()))
        self._process.start()
        # Only the engine process may hold its ends, so that its exit reads as end-of-file here.
        command_read.close()
        event_write.close()
        self._writer = CommandWriter(self._commands, self._fail, name="hybridkv-engine-writer")
        atexit.register(self.close)
        message = self._receive()
        if not isinstance(message, EngineReady):
            self.close()
            raise self._error_from(message)
        self.capacity, self.model_info, self.stats = message.capacity, message.model_info, message.stats
        self.worker_pids = message.worker_pids
        self._last_event_s = time.monotonic()
        self._reader = threading.Thread(target=self._read_loop, name="hybridkv-engine-reader", daemon=True)
        self._reader.start()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        """Queues a request validated by the caller; a refusal the engine alone can see comes to `on_rejected`."""
        self._send(AddRequest(request_id, prompt_token_ids, params), outstanding=True)

    def abort(self, request_id: str) -> None:
        """Asks the engine to free the request's slot and blocks at its next step; a gone engine holds nothing."""
        try:
            self._send(AbortRequest(request_id))
        except EngineProcessError:
            pass

    def request_capacity(self) -> concurrent.futures.Future:
        """The engine's CapacityReport as a dict, taken after it has applied every command sent before this one.

        The caller may cancel the future or stop waiting at any time: the waiter is dropped, the answer ignored.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        query_id = next(self._next_query_id)
        with self._lock:
            self._capacity_waiters[query_id] = future
        future.add_done_callback(lambda _: self._drop_waiter(query_id))
        try:
            self._send(CapacityQuery(query_id))
        except EngineProcessError as exc:
            _settle(future, exception=exc)
        return future

    def stalled_for_s(self, busy: bool) -> float:
        """Seconds the engine has had work (`busy`, or a query or add not yet answered) without sending anything."""
        with self._lock:
            waiting = busy or self._outstanding > 0 or bool(self._capacity_waiters)
            return time.monotonic() - self._last_event_s if waiting else 0.0

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Asks the engine process to finish its aborted requests and exit; terminates it if it does not in time."""
        atexit.unregister(self.close)
        if self._process is None or self._closing:
            return
        self._closing = True
        try:
            self._send(StopEngine())
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
        if self._writer is not None:
            self._writer.close(TERMINATE_TIMEOUT_S)
        self._commands.close()
        self._events.close()

    # ---------------------------------------------------------------------------------------------- internals

    def _send(self, command, outstanding: bool = False) -> None:
        """Queues `command` for the writer thread (a failed pipe reaches `on_failure`); raises once the engine has
        failed."""
        with self._lock:
            if self.error is not None:
                raise self.error
            self._writer.put(command)
            if outstanding:
                if self._outstanding == 0:
                    self._last_event_s = time.monotonic()  # the stall clock starts when the engine gets work
                self._outstanding += 1

    def _drop_waiter(self, query_id: int) -> None:
        with self._lock:
            self._capacity_waiters.pop(query_id, None)

    def _receive(self):
        """The engine process's next message, or None once it has exited or closed its end of the pipe."""
        try:
            ready = multiprocessing.connection.wait([self._events, self._process.sentinel])
            return self._events.recv() if self._events in ready else None
        except (EOFError, OSError, ValueError):  # ValueError, OSError: `close()` closed the pipe meanwhile
            return None

    def _read_loop(self) -> None:
        try:
            while self._handle(self._receive()):
                pass
        except Exception as exc:  # noqa: BLE001 - a reader that dies silently would wedge every caller
            log.exception("the engine reader failed")
            self._fail(EngineProcessError(f"the engine reader failed: {type(exc).__name__}: {exc}"))

    def _handle(self, message) -> bool:
        """Applies one event from the engine process; False once no more will come."""
        with self._lock:
            self._last_event_s = time.monotonic()
            self._outstanding = 0  # the engine loop came round: it has taken the adds sent before
        match message:
            case StepDone(outputs=outputs, stats=stats):
                self.stats = stats
                if outputs:
                    self._on_outputs(outputs)
            case StatsChanged(stats=stats):
                self.stats = stats
            case CapacityAnswer(query_id=query_id, capacity=capacity):
                with self._lock:
                    waiter = self._capacity_waiters.pop(query_id, None)
                if waiter is not None:
                    _settle(waiter, result=capacity)
            case RequestRejected(request_id=request_id, reason=reason):
                self._on_rejected(request_id, reason)
            case EngineStopped(stats=stats):
                self.stats = stats
                return False
            case None | EngineFailed():
                self._fail(self._error_from(message))
                return False
            case _:
                self._fail(EngineProcessError(f"unexpected message from the engine process: {type(message).__name__}"))
                return False
        return True

    def _fail(self, error: BaseException) -> None:
        """Once, from whichever thread finds the failure first (the reader or the writer)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            waiters, self._capacity_waiters = self._capacity_waiters, {}
        for waiter in waiters.values():
            _settle(waiter, exception=error)
        if not self._closing:
            log.error("%s", error)
            self._on_failure(error)

    def _error_from(self, message) -> BaseException:
        """The error an EngineFailed carries, or one that names how the engine process ended."""
        if isinstance(message, EngineFailed):
            return UserError(message.reason) if message.user_error else EngineProcessError(
                f"{message.error_type}: {message.reason}")
        self._process.join(TERMINATE_TIMEOUT_S)
        code = self._process.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        elif code is not None:
            how = f"exited with code {code}"
        else:
            how = "closed its pipe"
        return EngineProcessError(f"the engine process (pid {self._process.pid}) {how}")


def _settle(future: concurrent.futures.Future, result=None, exception: BaseException | None = None) -> None:
    """Completes a waiter unless its caller already gave up on it (a cancelled future refuses a result)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


# -------------------------------------------------------------------------------------------- engine process

def _engine_main(config, commands, events, parent_pid: int, log_level: int) -> None:
    """Entry point of the engine process: build the engine, report what it measured, then serve commands. It logs
    at the server's level (its start-up report among its lines)."""
    # The server process decides when to stop; Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent_pid)
    configure_logging(log_level)
    from hybridkv.sidecar.core.engine import Engine

    try:
        engine = Engine(config)
    except Exception as exc:  # noqa: BLE001 - every start-up failure goes back to the server, which reports it
        _send_failure(events, exc)
        sys.exit(1)
    try:
        worker_pids = tuple(worker.pid for worker in engine.executor.worker_processes) if engine.executor else ()
        events.send(EngineReady(engine.capacity().to_dict(), engine.model_info(), engine.stats(), worker_pids))
        _serve(engine, commands, events)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.warning("the server process is gone; the engine process stops")
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - any engine failure must end every stream, not hang them
        log.exception("engine step failed; the engine process stops")
        _send_failure(events, exc)
        sys.exit(1)
    finally:
        engine.close()


def _serve(engine, commands, events) -> None:
    """Applies commands and steps until told to stop and every request has ended. Outputs the engine reads between
    two layers of a step's launch go out at once, before the step's own."""
    engine.output_sink = lambda outputs: events.send(StepDone(outputs, engine.stats()))
    stopping = False
    capacity_queries: list[int] = []
    last_stats = None
    while True:
        busy = engine.has_unfinished_requests()
        if not busy and stopping:
            events.send(EngineStopped(engine.stats()))
            return
        applied = 0
        while applied < MAX_COMMANDS_PER_STEP and commands.poll(IDLE_WAIT_S if not (busy or applied) else 0):
            stopping |= _apply(engine, commands.recv(), events, capacity_queries)
            applied += 1
        if engine.has_unfinished_requests():
            outputs = engine.step()
            last_stats = engine.stats()
            events.send(StepDone(outputs, last_stats))
        else:
            stats = engine.stats()
            if stats != last_stats or applied:
                events.send(StatsChanged(stats))
                last_stats = stats
        for query_id in capacity_queries:
            events.send(CapacityAnswer(query_id, engine.capacity().to_dict()))
        capacity_queries.clear()


def _apply(engine, command, events, capacity_queries: list[int]) -> bool:
    """Applies one command from the server; True for StopEngine."""
    from hybridkv.sidecar.core.sampling import RequestError

    match command:
        case AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params):
            try:
                engine.add_request(request_id, prompt_token_ids, params)
            except RequestError as exc:
                events.send(RequestRejected(request_id, str(exc)))
        case AbortRequest(request_id=request_id):
            engine.abort(request_id)
        case CapacityQuery(query_id=query_id):
            capacity_queries.append(query_id)
        case StopEngine():
            return True
        case _:
            raise UnknownMessageError(f"unknown command {type(command).__name__} from the server process")
    return False


def _send_failure(events, exc: BaseException) -> None:
    try:
        events.send(EngineFailed(type(exc).__name__, str(exc), isinstance(exc, UserError)))
    except OSError:
        log.warning("the server process is gone; it cannot be told: %s", exc)
