"""The aiohttp application of the OpenAI-compatible API, over the serving Frontend that the gRPC door uses too.

Every choice of a request is one Frontend request (n > 1 derives ids, and seeds from a given seed). The first output
of every choice is awaited before the HTTP status is sent, so refusals get their own status; a stream that fails later
ends with an error event. A client that goes away cancels the handler, which closes the Frontend iterators: that
aborts the engine requests and frees their slots and blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import ssl
import time
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hybridkv.errors import UserError, excerpt
from hybridkv.sidecar.serving.frontend import EngineFailedError, QueueFullError, UnavailableError
from hybridkv.sidecar.serving.openai.chat import ChatTemplate
from hybridkv.sidecar.serving.openai.output import ChatOutputStream, OutputParsing, new_tool_call_id
from hybridkv.sidecar.serving.openai.protocol import (ChatRequest, Options, parse_chat, parse_completion,
                                                      parse_detokenize, parse_tokenize)
from hybridkv.sidecar.serving.openai.reasoning import THINK_CLOSE, prompt_opens_reasoning
from hybridkv.sidecar.serving.openai.tool_calls import forced_prefix

log = logging.getLogger(__name__)

# Set on a request once its event stream has begun (an error after that cannot become a response of its own).
_STREAM_STARTED = (web.RequestKey("stream_started", bool) if hasattr(web, "RequestKey")  # aiohttp 3.13+
                   else "hybridkv.stream_started")

MAX_BODY_BYTES = 32 * 1024 * 1024
UNAUTHENTICATED_PATHS = frozenset({"/health", "/metrics"})
FRONTEND = web.AppKey("frontend", object)
SETTINGS = web.AppKey("settings", object)


@dataclasses.dataclass(frozen=True)
class HttpSettings:
    served_model_name: str
    auth_token: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class HttpError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.error_type = status, message, param, error_type
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.status}}


def http_error_of(exc: BaseException) -> HttpError:
    """The status and body of an error a Frontend raised before a request's first output."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, UserError):
        return HttpError(400, str(exc), getattr(exc, "param", None))
    if isinstance(exc, QueueFullError):
        seconds = max(1, math.ceil(exc.retry_after_ms / 1000))
        return HttpError(429, str(exc), error_type="rate_limit_error",
                         headers={"Retry-After": str(seconds), "retry-after-ms": str(exc.retry_after_ms)})
    if isinstance(exc, UnavailableError):
        return HttpError(503, str(exc), error_type="service_unavailable")
    if isinstance(exc, EngineFailedError):
        return HttpError(500, f"the engine failed: {exc}", error_type="server_error")
    raise exc


class _ProtocolErrorLog(logging.Filter):
    """aiohttp logs a traceback at ERROR for every request it cannot parse (a bad Content-Length, a header name with
    a space), after answering it 400. Those are the client's mistakes: at most one warning per interval here,
    counting them, so a flood of them cannot flood the log."""

    def __init__(self, interval_s: float = 60.0):
        super().__init__()
        self.interval_s = interval_s
        self._since_last = 0
        self._last_s = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError) or (getattr(error, "code", 400) or 400) >= 500:
            return True
        self._since_last += 1
        now_s = time.monotonic()
        if now_s - self._last_s >= self.interval_s:
            log.warning("%d HTTP request(s) could not be parsed in the last %.0f s and were answered 400 (latest: "
                        "%s)", self._since_last, self.interval_s, " ".join(str(error).split())[:200])
            self._since_last, self._last_s = 0, now_s
        return False


_PROTOCOL_ERROR_LOG = _ProtocolErrorLog()


def _quiet_protocol_errors() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if _PROTOCOL_ERROR_LOG not in server_log.filters:
        server_log.addFilter(_PROTOCOL_ERROR_LOG)


def decode_body(raw: bytes):
    """The request body's JSON: UTF-8 whatever charset the request names (JSON is UTF-8), every string valid
    Unicode (the tokenizer and the chat template take no lone surrogates), nesting and numbers within Python's
    limits. Anything else is a 400 that says which."""
    try:
        body = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise HttpError(400, f"the request body is not UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise HttpError(400, "the request body's JSON nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
        raise HttpError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise HttpError(400, "the request body holds a string that is not valid Unicode (an unpaired surrogate "
                             "escape such as \\ud800)") from None
    return body


def build_app(frontend, settings: HttpSettings, registry, chat_template: ChatTemplate | None) -> web.Application:
    """`chat_template` None: chat requests are refused with the reason (the checkpoint has no template)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors, _bearer_token(settings.auth_token)])
    app[FRONTEND] = frontend
    app[SETTINGS] = settings
    api = _Api(frontend, settings, chat_template)
    app.router.add_get("/health", api.health)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    return app


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except (HttpError, UserError) as exc:
        return http_error_of(exc).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return HttpError(exc.status, exc.reason).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - a server defect: logged with its traceback, answered in OpenAI's shape
        if request.get(_STREAM_STARTED):
            raise  # the event stream's headers are out: aiohttp can only close the connection
        log.exception("%s %s failed", request.method, request.path)
        return HttpError(500, "internal server error; the server log has the details",
                         error_type="server_error").response()


def _bearer_token(token: str | None):
    expected = None if token is None else f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if expected is not None and request.path not in UNAUTHENTICATED_PATHS:
            # Header bytes that are not UTF-8 reach us as surrogate escapes: compared as sent, never an error.
            presented = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(presented, expected):
                raise HttpError(401, "missing or wrong bearer token", error_type="authentication_error")
        return await handler(request)

    return check


@dataclasses.dataclass
class _Choice:
    """One Frontend request of an HTTP request, and what it has produced so far."""

    index: int
    outputs: object  # the Frontend's async iterator
    first: object = None
    token_ids: list = dataclasses.field(default_factory=list)
    text: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def take(self, output) -> None:
        self.token_ids.extend(output.new_token_ids)
        self.text.append(output.text_delta)
        self.logprobs.extend(output.logprobs or ())
        self.prompt_tokens, self.completion_tokens = output.prompt_tokens, output.completion_tokens
        self.cached_tokens = output.cached_tokens
        if output.finished:
            self.finish_reason = output.finish_reason or "stop"


class _Api:
    def __init__(self, frontend, settings: HttpSettings, chat_template: ChatTemplate | None):
        self.frontend = frontend
        self.settings = settings
        self.chat_template = chat_template
        self.created_s = int(time.time())

    # ------------------------------------------------------------------------------------------------ routes

    async def health(self, request: web.Request) -> web.Response:
        if self.frontend.ready and not self.frontend.draining:
            return web.json_response({"status": "ok"})
        status = "draining" if self.frontend.draining else "loading"
        return web.json_response({"status": status}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.settings.served_model_name, "object": "model", "created": self.created_s,
                "owned_by": "hybridkv"}
        if self.frontend.ready:
            card["max_model_len"] = self.frontend.model_info["max_model_len"]
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        parsed = parse_completion(body, self._model_info()["vocab_size"])
        prompts = [(prompt, index * parsed.options.n) for index, prompt in enumerate(parsed.prompts)]
        response_id = f"cmpl-{uuid.uuid4().hex}"
        choices = await self._start(response_id, prompts, parsed.options)
        shape = _CompletionShape(self, response_id, parsed.options)
        return await self._respond(request, choices, parsed.options, shape)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        parsed = parse_chat(body, self._model_info()["vocab_size"])
        prompt_ids, parsing, resume_tail = await self._render_chat(parsed)
        max_model_len = self._model_info()["max_model_len"]
        max_tokens = parsed.max_tokens or max_model_len - len(prompt_ids)
        if max_tokens < 1:
            raise HttpError(400, f"the rendered conversation is {len(prompt_ids)} tokens, which leaves none to "
                                 f"generate within max_model_len {max_model_len}; shorten the messages", "messages")
        options = dataclasses.replace(parsed.options, params=dataclasses.replace(
            parsed.options.params, max_tokens=max_tokens, resume_tail_tokens=resume_tail))
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = await self._start(response_id, [(prompt_ids, 0)], options, "messages")
        shape = _ChatShape(self, response_id, options, parsing)
        return await self._respond(request, choices, options, shape)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt's ids, or a conversation's as the chat endpoint renders it (its template,
        `add_generation_prompt`, `chat_template_kwargs`, `tools`), with the model length to read them against."""
        parsed = parse_tokenize(await self._body(request))
        max_model_len = self._model_info()["max_model_len"]
        if parsed.prompt is not None:
            text = parsed.prompt
        else:
            if self.chat_template is None:
                raise HttpError(400, "the checkpoint has no chat template; send a prompt instead of messages",
                                "messages")
            kwargs = {**parsed.template_kwargs, "add_generation_prompt": parsed.add_generation_prompt}
            text = await asyncio.to_thread(self.chat_template.render, parsed.messages, parsed.tools or None, kwargs)
        tokens = await asyncio.to_thread(self.frontend.tokenizer.encode, text)
        return web.json_response({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.Response:
        info = self._model_info()
        tokens = parse_detokenize(await self._body(request), info["vocab_size"], info["max_model_len"])
        return web.json_response({"prompt": await asyncio.to_thread(self.frontend.tokenizer.decode, tokens)})

    # ------------------------------------------------------------------------------------------------ helpers

    def _model_info(self) -> dict:
        if not self.frontend.ready:
            raise HttpError(503, "the model is loading; retry when /health answers 200",
                            error_type="service_unavailable")
        return self.frontend.model_info

    async def _body(self, request: web.Request) -> dict:
        body = decode_body(await request.read())
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None and model != self.settings.served_model_name:
            raise HttpError(404, f"the model {excerpt(model)} does not exist; this server serves "
                                 f"{self.settings.served_model_name!r}", "model", error_type="not_found_error")
        return body

    async def _render_chat(self, parsed: ChatRequest) -> tuple[list[int], OutputParsing, int]:
        tool_parser = None if parsed.tool_choice == "none" else self.settings.tool_call_parser
        if parsed.tool_choice != "none" and tool_parser is None:
            raise HttpError(400, "tool calls need the server to run with --tool-call-parser (hermes or qwen3_coder); "
                                 'send tool_choice "none" to chat without them', "tools")
        if self.chat_template is None:
            raise HttpError(400, "the checkpoint has no chat template; send a raw prompt to /v1/completions",
                            "messages")
        # One hop to a worker thread for the whole render: under load each hop waits for a turn of the event loop.
        return await asyncio.to_thread(self._render_and_encode, parsed, tool_parser)

    def _render_and_encode(self, parsed: ChatRequest, tool_parser: str | None) -> tuple[list[int], OutputParsing, int]:
        """The conversation through the chat template, its ids, how its output is parsed, and its resume tail."""
        prompt_text = self.chat_template.render(parsed.messages, parsed.tools if tool_parser else None,
                                                parsed.template_kwargs)
        opens_reasoning = prompt_opens_reasoning(prompt_text)
        tool_prefix = forced_prefix(tool_parser, parsed.tool_name) if parsed.tool_choice == "required" else ""
        # A forced call is written after the reasoning the template opened, so that reasoning is closed first.
        closing = THINK_CLOSE + "\n\n" if tool_prefix and opens_reasoning else ""
        reasoning_parser = self.settings.reasoning_parser
        parsing = OutputParsing(reasoning_parser, tool_parser, parsed.tools, opens_reasoning and bool(reasoning_parser),
                                (closing if reasoning_parser else "") + tool_prefix)
        prompt_ids = self.frontend.tokenizer.encode(prompt_text + closing + tool_prefix)
        return prompt_ids, parsing, self._resume_tail_tokens(parsed, prompt_text, closing + tool_prefix,
                                                             len(prompt_ids))

    def _resume_tail_tokens(self, parsed: ChatRequest, prompt_text: str, appended: str, prompt_tokens: int) -> int:
        """Tokens at the end of the prompt the conversation's next turn will not send again (SamplingParams'
        `resume_tail_tokens`): the template's reply tail and what this request appended to it. One token more than
        they take alone, for the token where they meet the text before them."""
        tail = self.chat_template.reply_tail(parsed.template_kwargs)
        if not tail or not prompt_text.endswith(tail):
            tail = ""
        if not tail + appended:
            return 0
        return min(prompt_tokens - 1, len(self.frontend.tokenizer.encode(tail + appended)) + 1)

    async def _start(self, response_id: str, prompts: list, options: Options,
                     prompt_param: str = "prompt") -> list[_Choice]:
        """Submits n requests per prompt and waits for each one's first output; on a refusal the others are closed
        and the refusal is raised as an HttpError naming the parameter (`prompt_param`: where the prompt came from)."""
        wanted = len(prompts) * options.n
        limit = self.frontend.capacity["state_slots"] + self.frontend.max_queue
        if wanted > limit:  # would be refused on every retry, however idle the server: not a 429
            raise HttpError(400, f"this request asks for {wanted} completions (n x prompts) but the server holds at "
                                 f"most {limit} requests at once ({self.frontend.capacity['state_slots']} state slots "
                                 f"+ {self.frontend.max_queue} queued); lower n or send fewer prompts",
                            "n" if options.n > 1 else prompt_param)
        choices = []
        for prompt, first_index in prompts:
            for offset in range(options.n):
                index = first_index + offset
                params = options.params
                if params.seed is not None and index:
                    params = dataclasses.replace(params, seed=(params.seed + index) % 2**63)
                choices.append(_Choice(index, self.frontend.generate(f"{response_id}-{index}", prompt, params)))
        firsts = await asyncio.gather(*(anext(choice.outputs) for choice in choices), return_exceptions=True)
        refusals = [result for result in firsts if isinstance(result, BaseException)]
        if refusals:
            await asyncio.gather(*(choice.outputs.aclose() for choice in choices), return_exceptions=True)
            error = http_error_of(refusals[0])
            if error.status == 400 and error.param in (None, "prompt"):  # the prompt, as this endpoint takes it
                error.param = prompt_param
            raise error
        for choice, first in zip(choices, firsts):
            choice.first = first
        return choices

    async def _respond(self, request: web.Request, choices: list[_Choice], options: Options,
                       shape) -> web.StreamResponse:
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(choice, queue)) for choice in choices]
        try:
            if not options.stream:
                remaining = len(choices)
                while remaining:
                    choice, output = await queue.get()
                    if isinstance(output, BaseException):
                        raise http_error_of(output)
                    choice.take(output)
                    remaining -= output.finished
                return web.json_response(shape.whole(choices))
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await stream.prepare(request)
            request[_STREAM_STARTED] = True
            for chunk in shape.opening(choices):
                await _send_event(stream, chunk)
            remaining = len(choices)
            while remaining:
                choice, output = await queue.get()
                if isinstance(output, BaseException):
                    await _send_event(stream, http_error_of(output).body())
                    break
                choice.take(output)
                remaining -= output.finished
                for chunk in shape.chunks(choice, output):
                    await _send_event(stream, chunk)
            else:
                if options.include_usage:
                    await _send_event(stream, shape.usage_chunk(choices))
            await stream.write(b"data: [DONE]\n\n")
            await stream.write_eof()
            return stream
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await asyncio.gather(*(choice.outputs.aclose() for choice in choices), return_exceptions=True)


async def _pump(choice: _Choice, queue: asyncio.Queue) -> None:
    await queue.put((choice, choice.first))
    if choice.first.finished:
        return
    try:
        async for output in choice.outputs:
            await queue.put((choice, output))
    except (UserError, QueueFullError, UnavailableError, EngineFailedError) as exc:
        await queue.put((choice, exc))


async def _send_event(stream: web.StreamResponse, payload: dict) -> None:
    await stream.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")


def _usage(choices: list[_Choice], count_prompt_once_per: int) -> dict:
    # Each prompt's tokens count once however many choices it has (n), the cached ones as its first choice found them.
    firsts = choices[::count_prompt_once_per]
    prompt_tokens = sum(choice.prompt_tokens for choice in firsts)
    completion_tokens = sum(choice.completion_tokens for choice in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(choice.cached_tokens for choice in firsts)}}


class _CompletionShape:
    """Bodies of /v1/completions: the legacy `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset)."""

    object_name = "text_completion"

    def __init__(self, api: _Api, response_id: str, options: Options):
        self.api, self.response_id, self.options = api, response_id, options
        self.decode = api.frontend.tokenizer.decode

    def _envelope(self, choices: list, object_name: str) -> dict:
        return {"id": self.response_id, "object": object_name, "created": int(time.time()),
                "model": self.api.settings.served_model_name, "choices": choices}

    def _logprobs(self, entries, text_offset: int) -> dict | None:
        if self.options.params.logprobs is None:
            return None
        tokens, offsets, offset = [], [], text_offset
        for entry in entries:
            tokens.append(self.decode([entry[0]]))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [entry[1].logprob for entry in entries],
                "top_logprobs": [{self.decode([token_id]): value for token_id, value in entry[1].top}
                                 for entry in entries],
                "text_offset": offsets}

    def _extras(self, choice: _Choice, token_ids: list[int]) -> dict:
        return {"token_ids": token_ids} if self.options.return_token_ids else {}

    def whole(self, choices: list[_Choice]) -> dict:
        body = self._envelope([
            {"index": choice.index, "text": "".join(choice.text),
             "logprobs": self._logprobs(list(zip(choice.token_ids, choice.logprobs)), 0),
             "finish_reason": choice.finish_reason, **self._extras(choice, choice.token_ids)}
            for choice in choices], self.object_name)
        body["usage"] = _usage(choices, self.options.n)
        return body

    def opening(self, choices: list[_Choice]) -> list[dict]:
        return []

    def chunks(self, choice: _Choice, output) -> list[dict]:
        if not output.new_token_ids and not output.text_delta and not output.finished:
            return []
        emitted_chars = sum(len(piece) for piece in choice.text) - len(output.text_delta)
        entries = list(zip(output.new_token_ids, output.logprobs or ()))
        return [self._envelope([{"index": choice.index, "text": output.text_delta,
                                 "logprobs": self._logprobs(entries, emitted_chars),
                                 "finish_reason": choice.finish_reason if output.finished else None,
                                 **self._extras(choice, output.new_token_ids)}], self.object_name)]

    def usage_chunk(self, choices: list[_Choice]) -> dict:
        chunk = self._envelope([], self.object_name)
        chunk["usage"] = _usage(choices, self.options.n)
        return chunk


class _ChatShape(_CompletionShape):
    """Bodies of /v1/chat/completions: messages and deltas split into reasoning, content and tool calls."""

    def __init__(self, api: _Api, response_id: str, options: Options, parsing: OutputParsing):
        super().__init__(api, response_id, options)
        self.parsing = parsing
        self.streams: dict[int, ChatOutputStream] = {}

    def _chat_logprobs(self, entries) -> dict | None:
        if self.options.params.logprobs is None:
            return None

        def token(token_id: int, logprob: float) -> dict:
            text = self.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**token(token_id, entry.logprob),
                             "top_logprobs": [token(top_id, value) for top_id, value in entry.top]}
                            for token_id, entry in entries]}

    def _finish_reason(self, reason: str | None, has_tool_calls: bool) -> str | None:
        return "tool_calls" if reason == "stop" and has_tool_calls else reason

    def whole(self, choices: list[_Choice]) -> dict:
        from hybridkv.sidecar.serving.openai.output import parse_chat_output

        bodies = []
        for choice in choices:
            output = parse_chat_output(self.parsing, "".join(choice.text), final=True)
            message = {"role": "assistant", "content": output.content or (None if output.tool_calls else "")}
            if output.reasoning is not None:
                message["reasoning_content"] = output.reasoning or None
            if output.tool_calls:
                message["tool_calls"] = [{"id": new_tool_call_id(), "type": "function",
                                          "function": {"name": call.name, "arguments": call.arguments}}
                                         for call in output.tool_calls]
            bodies.append({"index": choice.index, "message": message,
                           "logprobs": self._chat_logprobs(list(zip(choice.token_ids, choice.logprobs))),
                           "finish_reason": self._finish_reason(choice.finish_reason, bool(output.tool_calls)),
                           **self._extras(choice, choice.token_ids)})
        body = self._envelope(bodies, "chat.completion")
        body["usage"] = _usage(choices, self.options.n)
        return body

    def opening(self, choices: list[_Choice]) -> list[dict]:
        for choice in choices:
            self.streams[choice.index] = ChatOutputStream(self.parsing)
        return [self._envelope([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}], "chat.completion.chunk")
                for choice in choices]

    def chunks(self, choice: _Choice, output) -> list[dict]:
        stream = self.streams[choice.index]
        delta = stream.feed(output.text_delta, final=output.finished)
        if not delta and not output.finished and not output.logprobs:
            return []
        body = {"index": choice.index, "delta": delta,
                "logprobs": self._chat_logprobs(list(zip(output.new_token_ids, output.logprobs or ()))),
                "finish_reason": self._finish_reason(choice.finish_reason, stream.has_tool_calls)
                if output.finished else None,
                **self._extras(choice, output.new_token_ids)}
        return [self._envelope([body], "chat.completion.chunk")]

    def usage_chunk(self, choices: list[_Choice]) -> dict:
        chunk = self._envelope([], "chat.completion.chunk")
        chunk["usage"] = _usage(choices, self.options.n)
        return chunk


class HttpServer:
    """The app on a port of its own (0: a free one), beside the gRPC server on the same event loop; HTTPS with
    `ssl_context`."""

    def __init__(self, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None):
        self.app, self.host, self.requested_port = app, host, port
        self.ssl_context = ssl_context
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        _quiet_protocol_errors()
        # Cancelling the handler when the client disconnects is what aborts its engine requests.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.requested_port, ssl_context=self.ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
