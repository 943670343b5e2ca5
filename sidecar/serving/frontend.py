"""The one owner of every request from its arrival to its last output, shared by the sidecar's front doors.

A front door (gRPC `Generate`, the HTTP API) hands `Frontend.generate` a request id, a prompt and sampling parameters
and iterates over the outputs; everything in between lives here:
- the request id is reserved before anything is awaited, so two calls with one id cannot both pass the check;
- admission is bounded (`state_slots + max_queue` requests in flight) before any tokenizing;
- a text prompt that cannot fit in `max_model_len` tokens is refused from its length alone, before it is tokenized;
- the engine request is added, its outputs are handed to the caller's iterator as they come, and whenever the
  iterator ends without a finished output (client gone, deadline, drain, a failure) the engine request is aborted,
  which frees its state slot and token blocks at the engine's next step;
- health is the truth: ready once the engine has measured its pools, not ready when draining; not live when the engine
  process failed, or has had work and sent nothing for `stall_timeout_s` (stopped, stuck), and live again if it
  resumes.
The engine runs in a process of its own (`engine_process`); one reader thread hands its outputs to the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from hybridkv.errors import UserError, excerpt
from hybridkv.sidecar.core.config import DEFAULT_STALL_TIMEOUT_S
from hybridkv.sidecar.core.outputs import RequestOutput, RequestTimings
from hybridkv.sidecar.core.sampling import RequestError, SamplingParams, validate_request
from hybridkv.sidecar.model.tokenizer import Tokenizer
from hybridkv.sidecar.serving.engine_process import EngineClient, EngineProcessError

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 128
# Prompts longer than this are tokenized off the event loop so other streams keep flowing.
INLINE_TOKENIZE_MAX_CHARS = 8192
# The retry hint is the expected time until one slot frees, kept within these bounds.
RETRY_AFTER_MIN_MS = 50
RETRY_AFTER_MAX_MS = 10_000
# Longest wait for the engine process to free its last requests and exit on shutdown.
ENGINE_STOP_TIMEOUT_S = 30.0
# Default longest wait for the engine process to answer a capacity query (it answers after its current step).
CAPACITY_TIMEOUT_S = 30.0
# How often the stall is checked.
STALL_CHECK_S = 1.0


class UnavailableError(RuntimeError):
    """The server cannot take requests now (loading, draining, the engine failed): send it elsewhere or later."""


class EngineFailedError(RuntimeError):
    """The engine failed while the request was in flight."""


class QueueFullError(RuntimeError):
    """Admission is full; retry after `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


@dataclasses.dataclass(frozen=True)
class Health:
    live: bool
    ready: bool
    reason: str = ""


@dataclasses.dataclass
class _Flight:
    """One request in flight: the engine outputs (or an ending: None for a drain abort, an exception) not yet taken."""

    arrival_s: float
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    in_engine: bool = False
    first_token_s: float | None = None
    last_token_s: float | None = None

    def push(self, item) -> None:
        self.pending.append(item)
        self.ready.set()

    async def take(self) -> list:
        """Everything pending, at least one item: a request that fell behind catches up in one message."""
        if not self.pending:
            await self.ready.wait()
        self.ready.clear()
        items = list(self.pending)
        self.pending.clear()
        return items


class Frontend:
    """The request owner around one engine process. `load()` starts the engine, `drain()`/`stop()` end it.

    `on_health(health)` callbacks run on the event loop whenever liveness or readiness changes; `on_finished(reason,
    duration_s)`, `on_tokens(arrival_s, first, count)` and `on_timings(timings, end_to_end_s)` (a request finished
    after its first token) feed the serving metrics.
    """

    def __init__(self, engine_config, *, max_queue: int = 256, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S):
        self.engine_config = engine_config
        self.max_queue = max_queue
        self.stall_timeout_s = stall_timeout_s
        self.engine: EngineClient | None = None
        self.tokenizer: Tokenizer | None = None
        self.capacity: dict | None = None
        self.model_info: dict | None = None
        self.engine_error: BaseException | None = None
        self.draining = False
        self.health = Health(live=True, ready=False, reason="loading")
        self.health_listeners: list[Callable[[Health], None]] = []
        self.finish_listeners: list[Callable[[str, float], None]] = []
        self.token_listeners: list[Callable[[float, float | None, int], None]] = []
        self.timing_listeners: list[Callable[[RequestTimings, float], None]] = []
        self._flights: dict[str, _Flight] = {}
        self._request_s_ewma: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stall_watch: asyncio.Task | None = None
        self._stalled = False
        self._stopped = False

    # ----------------------------------------------------------------------------------------------- lifecycle

    @property
    def ready(self) -> bool:
        return self.health.ready

    @property
    def stats(self):
        """The engine's EngineStats after its latest step (None before it has started)."""
        return None if self.engine is None else self.engine.stats

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    async def load(self) -> None:
        """Starts the engine process, which builds the engine and measures capacity, then turns ready."""
        self._loop = loop = asyncio.get_running_loop()
        self.tokenizer = await asyncio.to_thread(Tokenizer, self.engine_config.model)
        engine = EngineClient(
            self.engine_config,
            on_outputs=lambda outputs: loop.call_soon_threadsafe(self._dispatch, outputs),
            on_rejected=lambda request_id, reason: loop.call_soon_threadsafe(
                self._push, request_id, RequestError(reason)),
            on_failure=lambda error: loop.call_soon_threadsafe(self._fail_all, error),
        )
        self.engine = engine
        try:
            await asyncio.to_thread(engine.start)
        except EngineProcessError:
            if self.draining:  # a drain stopped the engine process while it was loading
                return
            raise
        if self.draining:  # a SIGTERM arrived while loading: never turn ready
            return
        self.capacity = engine.capacity
        self.model_info = engine.model_info
        self._stall_watch = asyncio.ensure_future(self._watch_stall())
        self._set_health(Health(live=True, ready=True))
        log.info("ready: %d token blocks of %d tokens, %d state slots", self.capacity["token_blocks"],
                 self.capacity["block_size"], self.capacity["state_slots"])

    async def drain(self, grace_period_s: float) -> None:
        """Stops admitting, lets requests in flight finish within the grace period, then aborts the rest."""
        self.draining = True
        self._set_health(dataclasses.replace(self.health, ready=False, reason="draining"))
        log.info("draining: %d requests in flight, grace period %.1f s", len(self._flights), grace_period_s)
        deadline_s = time.monotonic() + grace_period_s
        while self._flights and time.monotonic() < deadline_s:
            await asyncio.sleep(0.02)
        for request_id, flight in list(self._flights.items()):
            if flight.in_engine:
                self.engine.abort(request_id)
            flight.push(None)
        # Give the aborted requests a moment to send their last message before the front doors close.
        while self._flights and time.monotonic() < deadline_s + 1.0:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        """Stops the engine process (after `drain`, or at once: requests in flight then end UNAVAILABLE)."""
        if self._stopped:
            return
        self._stopped = True
        self.draining = True
        if self._stall_watch is not None:
            self._stall_watch.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close, ENGINE_STOP_TIMEOUT_S)

    # ------------------------------------------------------------------------------------------------- requests

    async def generate(self, request_id: str | None, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs until one is finished. Raises before its first output: RequestError (bad input),
        QueueFullError, UnavailableError; during: EngineFailedError. Closing the iterator early aborts the request."""
        self._check_serving()
        request_id = self._reserve(request_id)
        flight = self._flights[request_id]
        finished = False
        last: RequestOutput | None = None
        try:
            prompt_ids = await self._tokenize(prompt)
            validate_request(request_id, prompt_ids, params, self.model_info["max_model_len"],
                             self.model_info["vocab_size"])
            self._check_serving()  # the engine may have failed, or a drain begun, while the prompt was tokenized
            try:
                self.engine.add_request(request_id, prompt_ids, params)
            except EngineProcessError as exc:
                raise UnavailableError(f"the engine failed: {exc}") from exc
            flight.in_engine = True
            while not finished:
                items = await flight.take()
                outputs = [item for item in items if isinstance(item, RequestOutput)]
                endings = [item for item in items if not isinstance(item, RequestOutput)]
                if outputs:
                    # Outputs that piled up while the caller was busy go out as one.
                    last = outputs[0] if len(outputs) == 1 else merge_outputs(outputs)
                    self._observe_tokens(flight, last)
                    finished = last.finished
                    if finished and last.timings is not None:
                        end_to_end_s = time.perf_counter() - flight.arrival_s
                        for listener in self.timing_listeners:
                            listener(last.timings, end_to_end_s)
                        if flight.first_token_s is not None:
                            last = dataclasses.replace(
                                last, time_to_first_token_s=flight.first_token_s - flight.arrival_s)
                    yield last
                if finished or not endings:
                    continue
                ending = endings[0]
                if ending is None:  # aborted by a drain past its grace period
                    last, finished = _aborted(request_id, last), True
                    yield last
                elif isinstance(ending, UserError):  # refused by the engine alone: an id an abort still holds
                    flight.in_engine = False
                    raise ending
                else:
                    raise EngineFailedError(f"the engine failed: {ending}") from ending
        finally:
            del self._flights[request_id]
            if flight.in_engine and not finished:  # cancelled, deadline passed or failed: free slot and blocks now
                self.engine.abort(request_id)
            reason = last.finish_reason if finished and last is not None else "abort"
            duration_s = time.perf_counter() - flight.arrival_s
            if flight.in_engine:
                self._observe_request_duration(duration_s)
            for listener in self.finish_listeners:
                listener(reason or "stop", duration_s)

    async def capacity_report(self, timeout_s: float = CAPACITY_TIMEOUT_S) -> dict:
        """The engine's CapacityReport as a dict, taken after the commands sent before it; UnavailableError when the
        engine has failed or does not answer in time (the query is dropped, nothing is left waiting)."""
        if self.engine_error is not None:
            raise UnavailableError(f"the engine failed: {self.engine_error}")
        if self.capacity is None:
            raise UnavailableError("the model is loading; retry when health is SERVING")
        future = self.engine.request_capacity()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except EngineProcessError as exc:
            raise UnavailableError(f"the engine failed: {exc}") from exc
        except asyncio.TimeoutError:
            raise UnavailableError(f"the engine did not report its capacity within {timeout_s:.1f} s") from None
        finally:
            future.cancel()  # drops the waiter if the caller gave up first

    # ------------------------------------------------------------------------------------------------- helpers

    def _check_serving(self) -> None:
        if self.engine_error is not None:
            raise UnavailableError(f"the engine failed: {self.engine_error}")
        if self.draining:
            raise UnavailableError("the server is draining; send the request elsewhere")
        if self.capacity is None:
            raise UnavailableError("the model is loading; retry when health is SERVING")

    def _reserve(self, request_id: str | None) -> str:
        """Checks the id and the admission bound and holds the id, all before the first await."""
        if request_id is None or request_id == "":
            request_id = uuid.uuid4().hex
        elif (not isinstance(request_id, str) or len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isascii()
              or not request_id.isprintable()):
            raise RequestError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters, got "
                               f"{excerpt(request_id)}")
        elif request_id in self._flights:
            raise RequestError(f"request_id {excerpt(request_id)} is already in flight; use a unique id")
        limit = self.capacity["state_slots"] + self.max_queue
        if len(self._flights) >= limit:
            retry_after_ms = self._retry_after_ms()
            raise QueueFullError(
                f"queue full: {len(self._flights)} requests in flight (limit {limit} = {self.capacity['state_slots']} "
                f"state slots + {self.max_queue} queued); retry after {retry_after_ms} ms", retry_after_ms)
        self._flights[request_id] = _Flight(arrival_s=time.perf_counter())
        return request_id

    async def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty; send at least one token")
            return list(prompt)
        if not prompt:
            raise RequestError("the prompt is empty; send text or token ids")
        max_model_len = self.model_info["max_model_len"]
        # More characters than max_model_len tokens can stand for: refused without tokenizing it.
        if len(prompt) > max_model_len * self.tokenizer.max_token_chars:
            raise RequestError(
                f"the prompt has {len(prompt)} characters, more than max_model_len {max_model_len} tokens can hold "
                f"(at most {self.tokenizer.max_token_chars} characters a token); shorten it")
        if len(prompt) <= INLINE_TOKENIZE_MAX_CHARS:
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token")
        return prompt_ids

    def _dispatch(self, outputs) -> None:
        for output in outputs:
            self._push(output.request_id, output)

    def _push(self, request_id: str, item) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.push(item)

    def _fail_all(self, error: BaseException) -> None:
        self.engine_error = error
        for flight in self._flights.values():
            flight.push(error)
        self._set_health(Health(live=False, ready=False, reason=f"the engine failed: {error}"))

    async def _watch_stall(self) -> None:
        while True:
            await asyncio.sleep(STALL_CHECK_S)
            if self.engine_error is not None:
                return
            stalled_s = self.engine.stalled_for_s(busy=any(f.in_engine for f in self._flights.values()))
            stalled = stalled_s > self.stall_timeout_s
            if stalled and not self._stalled:
                log.error("the engine has had work and sent nothing for %.0f s; liveness turns NOT_SERVING",
                          stalled_s)
                self._set_health(Health(live=False, ready=False, reason="the engine makes no progress"))
            elif self._stalled and not stalled:
                log.warning("the engine makes progress again")
                self._set_health(Health(live=True, ready=not self.draining))
            self._stalled = stalled

    def _set_health(self, health: Health) -> None:
        if health == self.health:
            return
        self.health = health
        for listener in self.health_listeners:
            listener(health)

    def _retry_after_ms(self) -> int:
        # One slot frees, on average, every (request duration / running requests).
        running = max(1, self.stats.running if self.stats else 1)
        expected_ms = 1000.0 * (self._request_s_ewma or 1.0) / running
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, expected_ms)))

    def _observe_request_duration(self, duration_s: float) -> None:
        previous = self._request_s_ewma
        self._request_s_ewma = duration_s if previous is None else 0.8 * previous + 0.2 * duration_s

    def _observe_tokens(self, flight: _Flight, output: RequestOutput) -> None:
        count = len(output.new_token_ids)
        if count == 0:
            return
        for listener in self.token_listeners:
            listener(flight.arrival_s, flight.last_token_s, count)
        flight.last_token_s = time.perf_counter()
        if flight.first_token_s is None:
            flight.first_token_s = flight.last_token_s


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and logprobs in order, the last one's state and
    usage."""
    last = outputs[-1]
    return dataclasses.replace(
        last,
        new_token_ids=[token_id for output in outputs for token_id in output.new_token_ids],
        text_delta="".join(output.text_delta for output in outputs),
        logprobs=None if last.logprobs is None else [entry for output in outputs for entry in output.logprobs or ()],
    )


def _aborted(request_id: str, last: RequestOutput | None) -> RequestOutput:
    """The final output of a request aborted by a drain, keeping the usage of what it had already produced."""
    return RequestOutput(
        request_id=request_id, new_token_ids=[], text_delta="", finished=True, finish_reason="abort",
        prompt_tokens=last.prompt_tokens if last else 0, completion_tokens=last.completion_tokens if last else 0,
    )
