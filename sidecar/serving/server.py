"""The sidecar's gRPC server: the engine behind hybridkv.v1.GenerationService, health, reflection and metrics.

Requests are owned by the `Frontend` (which the HTTP API shares): this module only turns protobuf into its calls and
its outputs and errors into protobuf and status codes. Several outputs that pile up between two sends (a busy event
loop, or a client whose flow-control window is full) go out as one message.

Requests are parsed here rather than by grpcio, so a message that does not decode (invalid UTF-8 in a string, cut
bytes) is answered INVALID_ARGUMENT with a warning that at most one line per `DECODE_LOG_INTERVAL_S` reports. Every
status detail is cut to `MAX_DETAIL_CHARS`, since a reason that quotes a large input would exceed gRPC's metadata limit.

Readiness ("hybridkv.v1.Readiness" and "") turns SERVING only after the engine has loaded its weights and measured its
pools, and NOT_SERVING when draining starts; liveness ("hybridkv.v1.Liveness") turns NOT_SERVING when the engine
process fails or has work and makes no progress for `--engine-stall-timeout` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import signal
import ssl
import tempfile
import threading
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from hybridkv import __version__
from hybridkv.api import generation_pb2 as pb
from hybridkv.api.client import LIVENESS_SERVICE, READINESS_SERVICE, RETRY_AFTER_METADATA_KEY
from hybridkv.errors import UserError
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.serving.frontend import (
    DEFAULT_STALL_TIMEOUT_S,
    EngineFailedError,
    Frontend,
    Health,
    QueueFullError,
    UnavailableError,
)
from hybridkv.sidecar.serving.metrics import ServingMetrics
from hybridkv.sidecar.serving.openai.app import HttpServer, HttpSettings, build_app
from hybridkv.sidecar.serving.openai.chat import ChatTemplate

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Longest status detail sent: gRPC's metadata limit is 8 KiB for all of it.
MAX_DETAIL_CHARS = 1024
# Undecodable requests log at most one warning per this many seconds, with the count since the last.
DECODE_LOG_INTERVAL_S = 10.0
# Longest wait for the engine process to answer a capacity request (it answers after its current step).
CAPACITY_TIMEOUT_S = 30.0

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_CAPACITY_FIELDS = ("block_size", "token_blocks", "token_capacity", "state_slots", "token_pool_bytes",
                    "state_pool_bytes", "budget_bytes", "weights_bytes", "reserve_bytes", "checkpoint_slots",
                    "checkpoint_pool_bytes")
_PREDICTED_FIELDS = ("weights_bytes", "reserve_bytes", "budget_bytes", "token_blocks", "token_capacity", "state_slots",
                     "token_pool_bytes", "state_pool_bytes", "checkpoint_slots", "checkpoint_pool_bytes")
_OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                             "repetition_penalty", "min_p", "logprobs")
_USAGE_FIELDS = ("used_token_blocks", "used_state_slots", "running", "waiting", "cached_token_blocks",
                 "used_checkpoint_slots")
_MODEL_INFO_FIELDS = ("name", "model_type", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "vocab_size",
                      "dtype", "ssm_dtype", "device", "tensor_parallel_size", "block_size", "eos_token_ids",
                      "num_full_attention_layers", "num_linear_attention_layers", "cuda_graphs", "startup_phases",
                      "enable_prefix_caching")


def capacity_to_proto(report: dict) -> pb.CapacityReport:
    """The engine's CapacityReport dict as protobuf; a missing field raises KeyError rather than reading as 0."""
    return pb.CapacityReport(
        **{name: report[name] for name in _CAPACITY_FIELDS},
        tensor_parallel_size=report["tensor_parallel_size"],
        checkpoint_attention_tokens=report["checkpoint_attention_tokens"],
        per_rank=[pb.RankCapacity(**{name: rank[name] for name in _CAPACITY_FIELDS}) for rank in report["per_rank"]],
        predicted=pb.PredictedCapacity(**{name: report["predicted"][name] for name in _PREDICTED_FIELDS}),
        usage=pb.CapacityUsage(**{name: report["usage"][name] for name in _USAGE_FIELDS}),
    )


def model_info_to_proto(info: dict) -> pb.ModelInfo:
    """The engine's model info as protobuf; a missing field raises KeyError."""
    return pb.ModelInfo(**{name: info[name] for name in _MODEL_INFO_FIELDS}, server_version=__version__)


def params_from_proto(request: pb.GenerateRequest) -> SamplingParams:
    sampling, stopping = request.sampling, request.stopping
    # Unset optional fields keep SamplingParams' defaults.
    given = {name: getattr(sampling, name) for name in _OPTIONAL_SAMPLING_FIELDS if sampling.HasField(name)}
    if stopping.HasField("max_tokens"):
        given["max_tokens"] = stopping.max_tokens
    if stopping.HasField("min_tokens"):
        given["min_tokens"] = stopping.min_tokens
    return SamplingParams(
        top_k=sampling.top_k,
        stop=tuple(stopping.stop),
        stop_token_ids=tuple(stopping.stop_token_ids),
        ignore_eos=stopping.ignore_eos,
        include_stop_str_in_output=stopping.include_stop_str_in_output,
        **given,
        cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
        resume_tail_tokens=request.resume_tail_tokens,
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
    )


def _token_logprobs_to_proto(entry) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=entry.logprob,
                            top=[pb.TokenLogprob(token_id=token_id, logprob=value) for token_id, value in entry.top])


def bounded_detail(message: str) -> str:
    if len(message) <= MAX_DETAIL_CHARS:
        return message
    return message[: MAX_DETAIL_CHARS - 30] + f"... ({len(message)} characters)"


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
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    auth_token: str | None = None
    tls_cert_pem: bytes | None = None
    tls_key_pem: bytes | None = None
    # The OpenAI-compatible HTTP API; 0 turns it off (`hybridkv serve` defaults to 8000).
    http_port: int = 0
    # The model name the HTTP API answers to (and labels metrics with); None: the checkpoint folder's name.
    served_model_name: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @property
    def tls(self) -> bool:
        return self.tls_cert_pem is not None

    def model_name(self, model_dir: str) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(model_dir))


def server_ssl_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A TLS 1.2+ server context for the HTTP API from the same PEM certificate chain and key as gRPC's. Python's ssl
    loads them only from files: they go to a private temporary folder (mode 0700) that is removed once loaded."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="hybridkv-tls-") as folder:
        cert_path, key_path = os.path.join(folder, "tls.crt"), os.path.join(folder, "tls.key")
        for path, pem in ((cert_path, cert_pem), (key_path, key_pem)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
                handle.write(pem)
        try:
            context.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as exc:
            raise UserError(f"--tls-cert/--tls-key do not load as a PEM certificate chain and its private key "
                            f"({exc.reason or exc})") from None
    return context


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


class _DecodeFailureLog:
    """One warning per interval for requests that do not decode, so a flood of them cannot flood the log."""

    def __init__(self, interval_s: float = DECODE_LOG_INTERVAL_S):
        self.interval_s = interval_s
        self.total = 0
        self._since_last = 0
        self._last_s = float("-inf")

    def record(self, method: str, error: Exception) -> None:
        self.total += 1
        self._since_last += 1
        now_s = time.monotonic()
        if now_s - self._last_s >= self.interval_s:
            log.warning("%d request(s) did not decode in the last %.0f s (latest: %s: %s)", self._since_last,
                        self.interval_s, method, error)
            self._since_last, self._last_s = 0, now_s


class SidecarServer:
    """The gRPC sidecar around one Frontend. `start()` binds the ports, `load()` starts the engine, `drain()` stops."""

    def __init__(self, engine_config, server_config: ServerConfig | None = None):
        self.engine_config = engine_config
        self.config = server_config or ServerConfig()
        self.frontend = Frontend(engine_config, max_queue=self.config.max_queue,
                                 stall_timeout_s=self.config.stall_timeout_s)
        self.metrics = ServingMetrics(self.frontend, self.config.model_name(engine_config.model))
        self.registry = self.metrics.registry
        self.health = health_aio.HealthServicer()
        self.frontend.health_listeners.append(lambda health: asyncio.ensure_future(self._publish_health(health)))
        self.decode_failures = _DecodeFailureLog()
        self.port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._http: HttpServer | None = None
        self._servers: list[grpc.aio.Server] = []
        self._metrics_http = None
        self._draining = False
        self._stopped = asyncio.Event()

    @property
    def engine(self):
        """The engine process's client (None before `load()`)."""
        return self.frontend.engine

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    @property
    def stats_snapshot(self):
        return self.frontend.stats

    # ----------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Binds the gRPC (and health, metrics) ports and answers health; Generate is UNAVAILABLE until `load()`."""
        await self._publish_health(self.frontend.health)
        interceptors = [_BearerTokenInterceptor(self.config.auth_token)] if self.config.auth_token else []
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
        main = grpc.aio.server(interceptors=interceptors, options=options)
        main.add_generic_rpc_handlers((self._generation_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, main)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), main
        )
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls:
            credentials = grpc.ssl_server_credentials([(self.config.tls_key_pem, self.config.tls_cert_pem)])
            self.port = _bind(main.add_secure_port, address, "--port", credentials)
            health_only = grpc.aio.server(options=options)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, health_only)
            self.health_port = _bind(health_only.add_insecure_port, f"{self.config.host}:{self.config.health_port}",
                                     "--health-port")
            self._servers.append(health_only)
        else:
            self.port = _bind(main.add_insecure_port, address, "--port")
            self.health_port = self.port
        self._servers.insert(0, main)
        for server in self._servers:
            await server.start()
        if self.config.metrics_port:
            self._metrics_http, _ = start_http_server(self.config.metrics_port, self.config.host, self.registry)
            self.metrics_port = self._metrics_http.server_port
        if self.config.http_port:
            await self._start_http()
        log.info("gRPC on %s:%d (%s), health on %d, metrics on %s, HTTP on %s", self.config.host, self.port,
                 "TLS" if self.config.tls else "plaintext", self.health_port, self.metrics_port or "off",
                 f"{self.http_port} ({'HTTPS' if self.config.tls else 'plaintext'})" if self.http_port else "off")

    async def _start_http(self) -> None:
        """The OpenAI-compatible API over the same Frontend, so both doors share admission, ids and metrics."""
        settings = HttpSettings(self.config.model_name(self.engine_config.model), self.config.auth_token,
                                self.config.tool_call_parser, self.config.reasoning_parser)
        chat_template = await asyncio.to_thread(ChatTemplate, self.engine_config.model)
        app = build_app(self.frontend, settings, self.registry, chat_template if chat_template.available else None)
        tls = server_ssl_context(self.config.tls_cert_pem, self.config.tls_key_pem) if self.config.tls else None
        self._http = HttpServer(app, self.config.host, self.config.http_port, tls)
        await self._http.start()
        self.http_port = self._http.port

    async def load(self) -> None:
        """Starts the engine process, which builds the engine and measures capacity, then turns ready."""
        await self.frontend.load()
        if self.frontend.capacity is not None:
            self.metrics.describe_cache(self.frontend.capacity, str(
                self.frontend.model_info.get("name") or os.path.basename(self.engine_config.model)))

    async def drain(self, grace_period_s: float | None = None) -> None:
        """Stops admitting, lets in-flight requests finish for up to the grace period, aborts the rest, stops."""
        if self._draining:
            await self._stopped.wait()
            return
        self._draining = True
        await self.frontend.drain(self.config.grace_period_s if grace_period_s is None else grace_period_s)
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
        self.frontend.draining = True
        await self.health.enter_graceful_shutdown()
        for server in self._servers:
            await server.stop(grace=0.5)
        if self._http is not None:
            await self._http.stop()
        await self.frontend.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self._stopped.set()
        log.info("stopped")

    async def _publish_health(self, health: Health) -> None:
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(LIVENESS_SERVICE, serving if health.live else not_serving)
        for name in (READINESS_SERVICE, ""):
            await self.health.set(name, serving if health.live and health.ready else not_serving)

    # ---------------------------------------------------------------------------------------------------- RPCs

    def _generation_handler(self) -> grpc.GenericRpcHandler:
        """GenerationService with requests left as bytes: this module decodes them (see the module docstring)."""
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._decoded(pb.GenerateRequest, self.Generate, streaming=True),
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GetCapacity": grpc.unary_unary_rpc_method_handler(
                self._decoded(pb.GetCapacityRequest, self.GetCapacity),
                response_serializer=pb.CapacityReport.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._decoded(pb.GetModelInfoRequest, self.GetModelInfo),
                response_serializer=pb.ModelInfo.SerializeToString),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def _decoded(self, message_type, method, streaming: bool = False):
        async def parse(data: bytes, context):
            try:
                return message_type.FromString(data)
            except (DecodeError, UnicodeDecodeError) as exc:
                self.decode_failures.record(method.__name__, exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the {message_type.__name__} did not decode: {bounded_detail(str(exc))}")

        if streaming:
            async def stream_handler(data: bytes, context):
                request = await parse(data, context)
                async for response in method(request, context):
                    yield response
            return stream_handler

        async def unary_handler(data: bytes, context):
            return await method(await parse(data, context), context)
        return unary_handler

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        prompt_kind = request.WhichOneof("prompt")
        prompt = request.text if prompt_kind == "text" else list(request.token_ids.ids) if prompt_kind else ""
        outputs = self.frontend.generate(request.request_id or None, prompt, params_from_proto(request))
        try:
            output = await anext(outputs)
            while True:
                yield pb.GenerateResponse(
                    request_id=output.request_id,
                    text=output.text_delta,
                    token_ids=output.new_token_ids,
                    finished=output.finished,
                    finish_reason=FINISH_REASONS.get(output.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                    usage=pb.Usage(prompt_tokens=output.prompt_tokens, completion_tokens=output.completion_tokens,
                                   cached_tokens=output.cached_tokens),
                    logprobs=[_token_logprobs_to_proto(entry) for entry in output.logprobs or ()],
                    times=_request_times_to_proto(output),
                )
                if output.finished:
                    return
                output = await anext(outputs)
        except UserError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:  # only before the first output
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                         trailing_metadata=((RETRY_AFTER_METADATA_KEY, str(exc.retry_after_ms)),))
        except UnavailableError as exc:  # only before the first output
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except EngineFailedError as exc:
            await _abort(context, grpc.StatusCode.INTERNAL, str(exc))
        finally:
            await outputs.aclose()

    async def GetCapacity(self, request: pb.GetCapacityRequest, context) -> pb.CapacityReport:
        try:
            report = await self.frontend.capacity_report(CAPACITY_TIMEOUT_S)
        except UnavailableError as exc:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        return capacity_to_proto(report)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        if self.frontend.engine_error is not None or self.frontend.model_info is None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "the model is loading or the engine failed; "
                         "retry when health is SERVING")
        return model_info_to_proto(self.frontend.model_info)


def _bind(add_port, address: str, flag: str, *credentials) -> int:
    """Binds a port; one taken since the command line's own check (another process was quicker) is a UserError."""
    try:
        return add_port(address, *credentials)
    except RuntimeError as exc:
        raise UserError(f"cannot listen on {address} ({flag}): {exc}; free the port or choose another") from None


def _request_times_to_proto(output) -> pb.RequestTimes | None:
    """The last output's server-side times, when it has them (a request that had a first token)."""
    timings = output.timings
    if timings is None or output.time_to_first_token_s is None:
        return None
    return pb.RequestTimes(time_to_first_token_s=output.time_to_first_token_s, queue_s=timings.queue_s,
                           prefill_s=timings.prefill_s, decode_s=timings.decode_s)


async def _abort(context, code: grpc.StatusCode, message: str, trailing_metadata=()) -> None:
    await context.abort(code, bounded_detail(message), trailing_metadata=trailing_metadata)


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
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the server runs on."""
        return self._loop

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
