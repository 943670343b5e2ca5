"""The sidecar's gRPC server: the engine behind hybridkv.v1.GenerationService, health, reflection and metrics.

The engine runs in a process of its own (`engine_process`), so the Python time this process spends per streamed
message never holds the engine step's GIL. Each Generate call is an asyncio task that owns one engine request; one
reader thread receives each engine step's outputs and hands them to the event loop at once; outputs that pile up
between two sends (a busy event loop, or a client whose flow-control window is full) go out as one message. A call that
ends early (client cancel, deadline, drain) aborts its engine request in a `finally`, which frees the request's state
slot and token blocks at the engine's next step.

Admission is bounded: at most `state_slots + max_queue` requests are in flight (running plus waiting); past that a
call is answered RESOURCE_EXHAUSTED with a `retry-after-ms` hint. Readiness ("hybridkv.v1.Readiness" and "") turns
SERVING only after the engine has loaded its weights and measured its pools, and NOT_SERVING when draining starts;
liveness ("hybridkv.v1.Liveness") stays SERVING until the process stops or the engine loop fails.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridkv import __version__
from hybridkv.api import generation_pb2 as pb
from hybridkv.api import generation_pb2_grpc as pb_grpc
from hybridkv.api.client import LIVENESS_SERVICE, READINESS_SERVICE, RETRY_AFTER_METADATA_KEY
from hybridkv.errors import UserError
from hybridkv.sidecar.serving.engine_process import EngineClient, EngineProcessError
from hybridkv.sidecar.core.sampling import RequestError, SamplingParams, validate_request
from hybridkv.sidecar.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
MAX_REQUEST_ID_CHARS = 128
# Prompts longer than this are tokenized off the event loop so other streams keep flowing.
INLINE_TOKENIZE_MAX_CHARS = 8192
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# The retry hint is the expected time until one slot frees, kept within these bounds.
RETRY_AFTER_MIN_MS = 50
RETRY_AFTER_MAX_MS = 10_000
# Longest wait for the engine process to free its last requests and exit on shutdown.
ENGINE_STOP_TIMEOUT_S = 30.0
# Longest wait for the engine process to answer a capacity request (it answers after its current step).
CAPACITY_TIMEOUT_S = 30.0

OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                            "repetition_penalty", "min_p", "logprobs")
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# Bucket edges (seconds) of vLLM's TTFT and inter-token histograms, so dashboards built for vLLM read ours.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)


@dataclasses.dataclass
class ServerConfig:
    """Everything `hybridkv serve` decides besides the engine's own configuration."""

    host: str = "0.0.0.0"
    port: int = 50051
    # 0 turns the Prometheus endpoint off.
    metrics_port: int = 9400
    # Plaintext health port, used only when TLS is on (probes cannot speak TLS).
    health_port: int = 50052
    max_queue: int = 256
    grace_period_s: float = 30.0
    auth_token: str | None = None
    tls_cert_pem: bytes | None = None
    tls_key_pem: bytes | None = None

    @property
    def tls(self) -> bool:
        return self.tls_cert_pem is not None


@dataclasses.dataclass
class _Stream:
    """One Generate call in flight: the engine outputs not yet sent, and timing for the latency histograms.

    `pending` holds RequestOutputs, then possibly None (aborted by drain) or an exception (the engine refused the
    request, or failed).
    """

    arrival_s: float
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    last_token_s: float | None = None

    def push(self, item) -> None:
        self.pending.append(item)
        self.ready.set()

    async def take(self) -> list:
        """Everything pending, at least one item: a stream that fell behind catches up in one message."""
        if not self.pending:
            await self.ready.wait()
        self.ready.clear()
        items = list(self.pending)
        self.pending.clear()
        return items


class _BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>`; health checks are exempt (kubelet probes send none)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_handler = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(handler_call_details)
        return self._deny_handler


class _EngineStatsCollector:
    """Gauges and counters read from the engine process's latest stats snapshot at scrape time."""

    def __init__(self, server: SidecarServer):
        self._server = server

    def collect(self):
        stats = self._server.stats_snapshot
        if stats is None:
            return
        token_usage = stats.used_token_blocks / stats.total_token_blocks if stats.total_token_blocks else 0.0
        state_usage = stats.used_state_slots / stats.total_state_slots if stats.total_state_slots else 0.0
        gauges = (
            ("vllm:num_requests_running", "Requests running (holding a state slot).", stats.running),
            ("vllm:num_requests_waiting", "Requests waiting for a state slot or token blocks.", stats.waiting),
            ("vllm:kv_cache_usage_perc",
             "Cache usage 0-1: the fuller of the token pool and the state pool (what limits admission).",
             max(token_usage, state_usage)),
            ("hybridkv:token_pool_usage_perc", "Attention KV token pool usage, 0-1.", token_usage),
            ("hybridkv:state_pool_usage_perc", "GDN request-constant state pool usage, 0-1.", state_usage),
            ("hybridkv:token_blocks_used", "Token blocks held by live requests.", stats.used_token_blocks),
            ("hybridkv:token_blocks_total", "Usable token blocks (null block excluded).", stats.total_token_blocks),
            ("hybridkv:state_slots_used", "State slots held by running requests.", stats.used_state_slots),
            ("hybridkv:state_slots_total", "Usable state slots (null slot excluded).", stats.total_state_slots),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = (
            ("vllm:num_preemptions", "Preemptions (recompute) since start.", stats.preemptions_total),
            ("vllm:prompt_tokens", "Prompt tokens processed since start.", stats.prompt_tokens_total),
            ("vllm:generation_tokens", "Tokens generated since start.", stats.generation_tokens_total),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)


def _fill_message(message: Message, values: dict) -> Message:
    """Copies the keys of `values` that the message declares (recursively); None leaves a field unset."""
    for field in message.DESCRIPTOR.fields:
        value = values.get(field.name)
        if value is None:
            continue
        if field.message_type is not None:
            if field.is_repeated:
                for item in value:
                    _fill_message(getattr(message, field.name).add(), item)
            else:
                _fill_message(getattr(message, field.name), value)
        elif field.is_repeated:
            getattr(message, field.name).extend(value)
        else:
            setattr(message, field.name, value)
    return message


def _token_logprobs_message(entry) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=entry.logprob,
                            top=[pb.TokenLogprob(token_id=token_id, logprob=value) for token_id, value in entry.top])


class SidecarServer(pb_grpc.GenerationServiceServicer):
    """The gRPC sidecar around one engine process. `start()` binds the ports, `load()` starts the engine process,
    `drain()` stops."""

    def __init__(self, engine_config, server_config: ServerConfig | None = None):
        self.engine_config = engine_config
        self.config = server_config or ServerConfig()
        self.engine: EngineClient | None = None
        self.tokenizer: Tokenizer | None = None
        self.port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self._capacity: dict | None = None
        self._model_info: dict | None = None
        self._streams: dict[str, _Stream] = {}
        self._draining = False
        self._engine_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._request_s_ewma: float | None = None
        self._servers: list[grpc.aio.Server] = []
        self._metrics_http = None
        self._stopped = asyncio.Event()
        self.health = health_aio.HealthServicer()
        self._init_metrics()

    # ----------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Binds the gRPC (and health, metrics) ports and answers health; Generate is UNAVAILABLE until `load()`."""
        self._loop = asyncio.get_running_loop()
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        for name in (READINESS_SERVICE, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        interceptors = [_BearerTokenInterceptor(self.config.auth_token)] if self.config.auth_token else []
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
        main = grpc.aio.server(interceptors=interceptors, options=options)
        pb_grpc.add_GenerationServiceServicer_to_server(self, main)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, main)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), main
        )
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls:
            credentials = grpc.ssl_server_credentials([(self.config.tls_key_pem, self.config.tls_cert_pem)])
            self.port = main.add_secure_port(address, credentials)
            health_only = grpc.aio.server(options=options)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, health_only)
            self.health_port = health_only.add_insecure_port(f"{self.config.host}:{self.config.health_port}")
            self._servers.append(health_only)
        else:
            self.port = main.add_insecure_port(address)
            self.health_port = self.port
        self._servers.insert(0, main)
        for server in self._servers:
            await server.start()
        if self.config.metrics_port:
            self._metrics_http, _ = start_http_server(self.config.metrics_port, self.config.host, self.registry)
            self.metrics_port = self._metrics_http.server_port
        log.info("gRPC on %s:%d (%s), health on %d, metrics on %s", self.config.host, self.port,
                 "TLS" if self.config.tls else "plaintext", self.health_port, self.metrics_port or "off")

    @property
    def stats_snapshot(self):
        """The engine's EngineStats after its latest step (None before it has started)."""
        return None if self.engine is None else self.engine.stats

    async def load(self) -> None:
        """Starts the engine process, which builds the engine and measures capacity, then turns ready."""
        self.tokenizer = await asyncio.to_thread(Tokenizer, self.engine_config.model)
        loop = self._loop
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
            if self._draining:  # the drain stopped the engine process while it was loading
                return
            raise
        if self._draining:  # a SIGTERM arrived while loading: never turn ready
            return
        self._capacity = engine.capacity
        self._model_info = engine.model_info
        self.cache_config_info.info(self._cache_config_labels())
        for name in (READINESS_SERVICE, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("ready: %d token blocks of %d tokens, %d state slots", self._capacity["token_blocks"],
                 self._capacity["block_size"], self._capacity["state_slots"])

    async def drain(self, grace_period_s: float | None = None) -> None:
        """Stops admitting, lets in-flight requests finish for up to the grace period, aborts the rest, stops."""
        if self._draining:
            await self._stopped.wait()
            return
        self._draining = True
        grace_s = self.config.grace_period_s if grace_period_s is None else grace_period_s
        for name in (READINESS_SERVICE, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining: %d requests in flight, grace period %.1f s", len(self._streams), grace_s)
        deadline_s = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline_s:
            await asyncio.sleep(0.02)
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.push(None)
        # Give the aborted streams a moment to send their last message before the server closes.
        while self._streams and time.monotonic() < deadline_s + 1.0:
            await asyncio.sleep(0.01)
        await self._shutdown()

    async def stop(self) -> None:
        """Stops at once: in-flight calls end with CANCELLED."""
        self._draining = True
        await self._shutdown()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def _shutdown(self) -> None:
        if self._stopped.is_set():
            return
        await self.health.enter_graceful_shutdown()
        for server in self._servers:
            await server.stop(grace=0.5)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close, ENGINE_STOP_TIMEOUT_S)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self._stopped.set()
        log.info("stopped")

    # ------------------------------------------------------------------------------------------ engine events

    def _dispatch(self, outputs) -> None:
        for output in outputs:
            self._push(output.request_id, output)

    def _push(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.push(item)

    def _fail_all(self, exc: BaseException) -> None:
        self._engine_error = exc
        for stream in self._streams.values():
            stream.push(exc)
        asyncio.ensure_future(self._mark_unhealthy())

    async def _mark_unhealthy(self) -> None:
        for name in (LIVENESS_SERVICE, READINESS_SERVICE, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    # ---------------------------------------------------------------------------------------------------- RPCs

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        await self._check_serving(context)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt_ids, params = await self._parse_generate(request, request_id)
        except UserError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        in_flight_limit = self._capacity["state_slots"] + self.config.max_queue
        if len(self._streams) >= in_flight_limit:
            retry_after_ms = self._retry_after_ms()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"queue full: {len(self._streams)} requests in flight (limit {in_flight_limit} = "
                f"{self._capacity['state_slots']} state slots + {self.config.max_queue} queued); "
                f"retry after {retry_after_ms} ms",
                trailing_metadata=((RETRY_AFTER_METADATA_KEY, str(retry_after_ms)),),
            )
        stream = _Stream(arrival_s=time.perf_counter())
        self._streams[request_id] = stream
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except EngineProcessError as exc:
            del self._streams[request_id]
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine failed: {exc}")
        finish_reason = None
        try:
            while finish_reason is None:
                items = await stream.take()
                outputs = [item for item in items if item is not None and not isinstance(item, BaseException)]
                if outputs:
                    last = outputs[-1]
                    if len(outputs) == 1:
                        token_ids, text = last.new_token_ids, last.text_delta
                    else:
                        token_ids = [token_id for output in outputs for token_id in output.new_token_ids]
                        text = "".join(output.text_delta for output in outputs)
                    self._observe_tokens(stream, len(token_ids))
                    if last.finished:
                        finish_reason = last.finish_reason or "stop"
                    yield pb.GenerateResponse(
                        request_id=request_id,
                        text=text,
                        token_ids=token_ids,
                        finished=last.finished,
                        finish_reason=FINISH_REASONS.get(finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                        usage=pb.Usage(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens),
                        logprobs=[_token_logprobs_message(entry) for output in outputs
                                  for entry in output.logprobs or ()],
                    )
                if finish_reason is not None or len(outputs) == len(items):
                    continue
                for item in items:
                    if isinstance(item, UserError):  # refused by the engine alone: an id still held by an abort
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                    if isinstance(item, BaseException):
                        await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {item}")
                # The only other item is None: aborted by drain past its grace period.
                finish_reason = "abort"
                yield pb.GenerateResponse(request_id=request_id, finished=True, finish_reason=pb.FINISH_REASON_ABORT)
        finally:
            del self._streams[request_id]
            if finish_reason is None:  # cancelled, deadline passed or failed: free the slot and blocks now
                self.engine.abort(request_id)
                finish_reason = "abort"
            self.request_success.labels(finished_reason=finish_reason).inc()
            self._observe_request_duration(time.perf_counter() - stream.arrival_s)

    async def GetCapacity(self, request: pb.GetCapacityRequest, context) -> pb.CapacityReport:
        await self._check_loaded(context)
        try:
            report = await asyncio.wait_for(asyncio.wrap_future(self.engine.request_capacity()), CAPACITY_TIMEOUT_S)
        except EngineProcessError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine failed: {exc}")
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the engine did not report its capacity within {CAPACITY_TIMEOUT_S:.0f} s")
        return _fill_message(pb.CapacityReport(), report)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        await self._check_loaded(context)
        info = _fill_message(pb.ModelInfo(), self._model_info)
        info.server_version = __version__
        return info

    # ------------------------------------------------------------------------------------------------- helpers

    async def _check_loaded(self, context) -> None:
        if self._engine_error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine failed: {self._engine_error}")
        if self.engine is None or self._capacity is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading; retry when health is SERVING")

    async def _check_serving(self, context) -> None:
        await self._check_loaded(context)
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining; send the request elsewhere")

    async def _parse_generate(self, request: pb.GenerateRequest, request_id: str):
        if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isascii() or not request_id.isprintable():
            raise RequestError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters")
        if request_id in self._streams:
            raise RequestError(f"request_id {request_id!r} is already in flight; use a unique id")
        prompt_kind = request.WhichOneof("prompt")
        if prompt_kind == "text":
            if not request.text:
                raise RequestError("the prompt is empty; send text or token ids")
            if len(request.text) <= INLINE_TOKENIZE_MAX_CHARS:
                prompt_ids = self.tokenizer.encode(request.text)
            else:
                prompt_ids = await asyncio.to_thread(self.tokenizer.encode, request.text)
        elif prompt_kind == "token_ids":
            prompt_ids = list(request.token_ids.ids)
        else:
            raise RequestError("the prompt is empty; set `text` or `token_ids`")
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token")
        sampling, stopping = request.sampling, request.stopping
        # Unset optional fields keep SamplingParams' defaults.
        given = {name: getattr(sampling, name) for name in OPTIONAL_SAMPLING_FIELDS if sampling.HasField(name)}
        if stopping.HasField("max_tokens"):
            given["max_tokens"] = stopping.max_tokens
        params = SamplingParams(
            top_k=sampling.top_k,
            stop=tuple(stopping.stop),
            stop_token_ids=tuple(stopping.stop_token_ids),
            ignore_eos=stopping.ignore_eos,
            **given,
        )
        validate_request(request_id, prompt_ids, params, self._model_info["max_model_len"],
                         self._model_info["vocab_size"])
        return prompt_ids, params

    def _retry_after_ms(self) -> int:
        # One slot frees, on average, every (request duration / running requests).
        running = max(1, self.stats_snapshot.running if self.stats_snapshot else 1)
        expected_ms = 1000.0 * (self._request_s_ewma or 1.0) / running
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, expected_ms)))

    def _observe_request_duration(self, duration_s: float) -> None:
        previous = self._request_s_ewma
        self._request_s_ewma = duration_s if previous is None else 0.8 * previous + 0.2 * duration_s

    def _observe_tokens(self, stream: _Stream, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now_s = time.perf_counter()
        if stream.last_token_s is None:
            self.time_to_first_token.observe(now_s - stream.arrival_s)
            num_tokens -= 1
        else:
            gap_s = (now_s - stream.last_token_s) / num_tokens
            for _ in range(num_tokens):
                self.inter_token_latency.observe(gap_s)
        stream.last_token_s = now_s

    # ------------------------------------------------------------------------------------------------- metrics

    def _init_metrics(self) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(self))
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time from request arrival to its first token.",
            buckets=TTFT_BUCKETS_S, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
            buckets=INTER_TOKEN_BUCKETS_S, registry=self.registry,
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason (abort includes client cancels).",
            labelnames=("finished_reason",), registry=self.registry,
        )
        self.cache_config_info = Info(
            "hybridkv:cache_config", "The measured dual-pool cache configuration.", registry=self.registry
        )

    def _cache_config_labels(self) -> dict[str, str]:
        capacity = self._capacity
        return {
            "model_name": str(self._model_info.get("name") or os.path.basename(self.engine_config.model)),
            "block_size": str(capacity["block_size"]),
            "num_gpu_blocks": str(capacity["token_blocks"]),
            "kv_cache_size_tokens": str(capacity["token_capacity"]),
            "state_slots": str(capacity["state_slots"]),
            "token_pool_bytes": str(capacity["token_pool_bytes"]),
            "state_pool_bytes": str(capacity["state_pool_bytes"]),
            "tensor_parallel_size": str(capacity["tensor_parallel_size"]),
        }


async def serve(engine_config, server_config: ServerConfig) -> None:
    """Runs the sidecar until SIGTERM or SIGINT, then drains within the grace period."""
    server = SidecarServer(engine_config, server_config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    try:
        await server.load()
    except BaseException:
        await server.stop()
        raise
    await server.wait_stopped()


class BackgroundServer:
    """A SidecarServer on its own event loop in a daemon thread: for embedding in a program, tests and benchmarks."""

    def __init__(self, engine_config, server_config: ServerConfig | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hybridkv-grpc", daemon=True)
        self._thread.start()

        async def build() -> SidecarServer:
            return SidecarServer(engine_config, server_config)

        self.server = self.call(build())

    def call(self, coroutine, timeout_s: float | None = None):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def start(self) -> BackgroundServer:
        self.call(self.server.start())
        return self

    def load(self) -> BackgroundServer:
        self.call(self.server.load())
        return self

    def drain(self, grace_period_s: float | None = None) -> None:
        self.call(self.server.drain(grace_period_s))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self.call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
