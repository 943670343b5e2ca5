"""A small torch-free client of the hybridkv sidecar API (sync and asyncio), and `fetch_capacity` for the operator.

    with GenerationClient("localhost:50051") as client:
        for response in client.generate("The capital of France is", max_tokens=16, temperature=0):
            print(response.text, end="", flush=True)
        print(client.get_capacity()["token_capacity"])

Errors are the channel's `grpc.RpcError` (the async client's `grpc.aio.AioRpcError`), whose `.code()` and
`.details()` say what went wrong (see docs/api.md for the status codes).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridkv.api import generation_pb2 as pb
from hybridkv.api import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "localhost:50051"
LIVENESS_SERVICE = "hybridkv.v1.Liveness"
READINESS_SERVICE = "hybridkv.v1.Readiness"
# Trailing metadata key of RESOURCE_EXHAUSTED answers: milliseconds to wait before retrying.
RETRY_AFTER_METADATA_KEY = "retry-after-ms"

FINISH_REASON_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


def build_generate_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    min_p: float | None = None,
    logprobs: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    request_id: str = "",
    cache_salt: str | None = None,
    resume_tail_tokens: int = 0,
    logit_bias: Mapping[int, float] | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest for a text prompt (str) or a token-id prompt (sequence of ints); None leaves a default."""
    request = pb.GenerateRequest(request_id=request_id, resume_tail_tokens=resume_tail_tokens)
    if cache_salt is not None:
        request.cache_salt = cache_salt
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    request.sampling.top_k = top_k
    if temperature is not None:
        request.sampling.temperature = temperature
    if top_p is not None:
        request.sampling.top_p = top_p
    if seed is not None:
        request.sampling.seed = seed
    optional_sampling = dict(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                             repetition_penalty=repetition_penalty, min_p=min_p, logprobs=logprobs)
    for name, value in optional_sampling.items():
        if value is not None:
            setattr(request.sampling, name, value)
    if logit_bias:
        request.sampling.logit_bias.update(logit_bias)
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    if min_tokens is not None:
        request.stopping.min_tokens = min_tokens
    request.stopping.stop.extend(stop)
    request.stopping.stop_token_ids.extend(stop_token_ids)
    request.stopping.ignore_eos = ignore_eos
    request.stopping.include_stop_str_in_output = include_stop_str_in_output
    return request


def message_to_dict(message: Message) -> dict:
    """Plain dict of a message with proto field names; integers stay ints and an unset sub-message is None."""
    out: dict = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            if field.is_repeated:
                out[field.name] = [message_to_dict(item) for item in value]
            else:
                out[field.name] = message_to_dict(value) if message.HasField(field.name) else None
        elif field.is_repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def capacity_to_dict(report: pb.CapacityReport) -> dict:
    """The CapacityReport dict layout of the engine (`Engine.capacity().to_dict()`)."""
    return message_to_dict(report)


def _call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def _channel_options() -> list[tuple[str, int]]:
    # Streams are long-lived; keepalive notices a vanished server without waiting for the OS.
    return [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)]


class GenerationClient:
    """Blocking client. `tls_ca` (PEM bytes) switches to TLS; `token` is sent as a bearer token on every call."""

    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None, tls_ca: bytes | None = None):
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca)
            self._channel = grpc.secure_channel(target, credentials, options=_channel_options())
        else:
            self._channel = grpc.insecure_channel(target, options=_channel_options())
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _call_metadata(token)

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **options
    ) -> Iterator[pb.GenerateResponse]:
        """Streams GenerateResponse messages; `options` are those of `build_generate_request`."""
        request = build_generate_request(prompt, **options)
        return self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)

    def get_capacity(self, *, timeout_s: float | None = 5.0) -> dict:
        report = self._stub.GetCapacity(pb.GetCapacityRequest(), timeout=timeout_s, metadata=self._metadata)
        return capacity_to_dict(report)

    def get_model_info(self, *, timeout_s: float | None = 5.0) -> dict:
        info = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self._metadata)
        return message_to_dict(info)

    def check_health(self, service: str = "", *, timeout_s: float | None = 5.0) -> str:
        """The health status name ("SERVING", "NOT_SERVING", ...) of a health service name."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class AsyncGenerationClient:
    """asyncio client with the same methods as GenerationClient; use `async with` and `async for`."""

    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None, tls_ca: bytes | None = None):
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca)
            self._channel = grpc.aio.secure_channel(target, credentials, options=_channel_options())
        else:
            self._channel = grpc.aio.insecure_channel(target, options=_channel_options())
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _call_metadata(token)

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def generate(
        self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **options
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The call object: iterate it with `async for`, `.cancel()` it to abort the request."""
        request = build_generate_request(prompt, **options)
        return self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)

    async def get_capacity(self, *, timeout_s: float | None = 5.0) -> dict:
        report = await self._stub.GetCapacity(pb.GetCapacityRequest(), timeout=timeout_s, metadata=self._metadata)
        return capacity_to_dict(report)

    async def get_model_info(self, *, timeout_s: float | None = 5.0) -> dict:
        info = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self._metadata)
        return message_to_dict(info)

    async def check_health(self, service: str = "", *, timeout_s: float | None = 5.0) -> str:
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def fetch_capacity(
    target: str, timeout_s: float = 5.0, token: str | None = None, *, tls_ca: bytes | None = None
) -> dict:
    """GetCapacity of the sidecar at `target` ("host:port") as the CapacityReport dict; raises grpc.aio.AioRpcError."""
    async with AsyncGenerationClient(target, token=token, tls_ca=tls_ca) as client:
        return await client.get_capacity(timeout_s=timeout_s)
