"""OpenAI request bodies checked and turned into SamplingParams; each refusal names the parameter (a 400).

Parameters clients send routinely that change nothing here are accepted and ignored (`IGNORED_PARAMETERS`); any
other parameter this server does not implement is refused by name rather than silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hybridkv.errors import excerpt
from hybridkv.sidecar.core.sampling import MAX_LOGIT_BIAS_ENTRIES, RequestError, SamplingParams

IGNORED_PARAMETERS = frozenset({"user", "metadata", "store", "service_tier"})
# Choices per request (n times the prompts of a completion request).
MAX_CHOICES = 64
MAX_MESSAGES = 4096
MAX_TOOLS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "include_stop_str_in_output")
_COMMON_KEYS = frozenset({"model", "stream", "stream_options", "n", "stop", "max_tokens", "return_token_ids",
                          *_SAMPLING_KEYS}) | IGNORED_PARAMETERS
COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "logprobs", "echo", "best_of", "suffix", "logit_bias"}
CHAT_KEYS = _COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                            "parallel_tool_calls", "response_format", "chat_template_kwargs", "logit_bias"}
TOKENIZE_KEYS = frozenset({"model", "prompt", "messages", "add_generation_prompt", "chat_template_kwargs", "tools"})
DETOKENIZE_KEYS = frozenset({"model", "tokens"})


class ProtocolError(RequestError):
    """A request body this server cannot run, with the parameter to fix."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Options:
    """What every generation request sets besides its prompt."""

    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list  # each a str or a list of token ids
    options: Options


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    options: Options
    # None: up to the model length (chat's default), resolved once the prompt is rendered.
    max_tokens: int | None
    tools: list[dict] = field(default_factory=list)
    tool_choice: str = "none"  # "none", "auto" or "required" (a named function is "required" with a name)
    tool_name: str | None = None
    template_kwargs: dict = field(default_factory=dict)


# Keywords of transformers' `apply_chat_template` that choose how it renders (or what it returns) rather than being
# variables of the template, and the conversation itself: a request's chat_template_kwargs cannot set them.
RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "continue_final_message", "sanitize_control_tokens"))


def parse_completion(body, vocab_size: int) -> CompletionRequest:
    body = _object(body, COMPLETION_KEYS)
    prompts = _prompts(body.get("prompt"))
    if body.get("echo"):
        raise ProtocolError("echo is not supported: the response holds the generated text only", "echo")
    if body.get("suffix") is not None:
        raise ProtocolError("suffix (insertion) is not supported", "suffix")
    logprobs = body.get("logprobs")
    options = _options(body, _max_tokens(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS), logprobs, "logprobs",
                       vocab_size, choices_per_choice=len(prompts))
    best_of = body.get("best_of")
    if best_of is not None and best_of != options.n:
        raise ProtocolError("best_of must equal n (ranking candidates is not supported)", "best_of")
    return CompletionRequest(prompts, options)


def parse_chat(body, vocab_size: int) -> ChatRequest:
    body = _object(body, CHAT_KEYS)
    messages = _messages(body.get("messages"))
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise ProtocolError("send max_completion_tokens or max_tokens, not both", "max_completion_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, name, None)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ProtocolError("response_format other than {\"type\": \"text\"} (JSON mode, JSON schema) is not "
                            "supported", "response_format")
    want_logprobs = body.get("logprobs")
    if want_logprobs is not None and not isinstance(want_logprobs, bool):
        raise ProtocolError(f"logprobs must be true or false, got {excerpt(want_logprobs)}", "logprobs")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and not want_logprobs:
        raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    # Until the prompt is rendered the length limit is checked with one token to generate (or min_tokens, which the
    # rendered prompt's room is checked against later).
    min_tokens = body.get("min_tokens")
    floor = min_tokens if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 1 else 1
    options = _options(body, max_tokens or floor, logprobs, "top_logprobs", vocab_size)
    tools = _tools(body.get("tools"))
    tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError(f"parallel_tool_calls must be true or false, got {excerpt(parallel)}",
                            "parallel_tool_calls")
    return ChatRequest(messages, options, max_tokens, tools, tool_choice, tool_name, _template_kwargs(body))


@dataclass(frozen=True)
class TokenizeRequest:
    """POST /tokenize (vLLM's): a prompt's text, or a conversation rendered as the chat endpoint renders it."""

    prompt: str | None
    messages: list[dict] | None
    add_generation_prompt: bool = True
    tools: list[dict] = field(default_factory=list)
    template_kwargs: dict = field(default_factory=dict)


def parse_tokenize(body) -> TokenizeRequest:
    body = _object(body, TOKENIZE_KEYS)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError("send prompt (text) or messages (a conversation), one of them", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ProtocolError(f"prompt must be a non-empty string, got {excerpt(prompt)}", "prompt")
        chat_only = sorted(key for key in ("add_generation_prompt", "chat_template_kwargs", "tools") if key in body)
        if chat_only:
            raise ProtocolError(f"{chat_only[0]} goes with messages, not with a prompt", chat_only[0])
        return TokenizeRequest(prompt, None)
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise ProtocolError(f"add_generation_prompt must be true or false, got {excerpt(add_generation_prompt)}",
                            "add_generation_prompt")
    return TokenizeRequest(None, _messages(messages), add_generation_prompt, _tools(body.get("tools")),
                           _template_kwargs(body))


def parse_detokenize(body, vocab_size: int, max_tokens: int) -> list[int]:
    """POST /detokenize (vLLM's): the token ids to turn into text, at most `max_tokens` of them."""
    tokens = _object(body, DETOKENIZE_KEYS).get("tokens")
    if (not isinstance(tokens, list) or not tokens or len(tokens) > max_tokens
            or not all(isinstance(token, int) and not isinstance(token, bool) for token in tokens)):
        raise ProtocolError(f"tokens must be a list of 1 to {max_tokens} token ids", "tokens")
    outside = next((token for token in tokens if not 0 <= token < vocab_size), None)
    if outside is not None:
        raise ProtocolError(f"token id {outside} is outside the vocabulary [0, {vocab_size})", "tokens")
    return tokens


def _template_kwargs(body: dict) -> dict:
    template_kwargs = body.get("chat_template_kwargs")
    template_kwargs = {} if template_kwargs is None else template_kwargs
    if not isinstance(template_kwargs, dict) or not all(isinstance(key, str) for key in template_kwargs):
        raise ProtocolError("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs))
    if reserved:
        raise ProtocolError(f"chat_template_kwargs cannot set {reserved[0]!r}: it is how the server renders, not a "
                            "template variable", "chat_template_kwargs")
    return template_kwargs


# ------------------------------------------------------------------------------------------------------- helpers


def _object(body, allowed: frozenset) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    unknown = sorted(key for key in body if key not in allowed)
    if unknown:
        raise ProtocolError(f"unsupported parameter {excerpt(unknown[0])}; see docs/api.md for the parameters this "
                            "server takes", unknown[0])
    if body.get("stream_options") is not None and not body.get("stream"):
        raise ProtocolError("stream_options needs stream: true", "stream_options")
    return body


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(item, int) and not isinstance(item, bool)
                                                     for item in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(item, str) for item in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(item, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in item)
            for item in prompt):
        prompts = list(prompt)
    else:
        raise ProtocolError("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                            "lists, and not empty", "prompt")
    if any(len(item) == 0 for item in prompts):
        raise ProtocolError("the prompt is empty; send text or token ids", "prompt")
    return prompts


def _max_tokens(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProtocolError(f"{name} must be a positive integer, got {excerpt(value)}", name)
    return value


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object from token ids (JSON keys, so strings of digits) to biases."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ProtocolError(f"logit_bias must be an object from token ids to biases, got {excerpt(bias)}",
                            "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ProtocolError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got {len(bias)}",
                            "logit_bias")
    pairs = []
    for key, value in bias.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int):
            raise ProtocolError(f"logit_bias keys must be token ids, got {excerpt(key)}", "logit_bias")
        pairs.append((key, value))
    return tuple(pairs)


def _options(body: dict, max_tokens: int, logprobs, logprobs_name: str, vocab_size: int,
             choices_per_choice: int = 1) -> Options:
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ProtocolError(f"n must be a positive integer, got {excerpt(n)}", "n")
    if n * choices_per_choice > MAX_CHOICES:
        if n == 1:
            raise ProtocolError(f"at most {MAX_CHOICES} prompts in one request, got {choices_per_choice}", "prompt")
        raise ProtocolError(f"n times the prompts must be at most {MAX_CHOICES}, got {n} x {choices_per_choice}",
                            "n")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ProtocolError(f"stream must be true or false, got {excerpt(stream)}", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise ProtocolError("stream_options takes only include_usage", "stream_options")
    if not isinstance(stream_options.get("include_usage", False), bool):
        raise ProtocolError(f"stream_options.include_usage must be true or false, got "
                            f"{excerpt(stream_options['include_usage'])}", "stream_options")
    return_token_ids = body.get("return_token_ids") or False
    if not isinstance(return_token_ids, bool):
        raise ProtocolError(f"return_token_ids must be true or false, got {excerpt(return_token_ids)}",
                            "return_token_ids")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list):
        raise ProtocolError("stop must be a string or a list of strings", "stop")
    given = {key: body[key] for key in _SAMPLING_KEYS if body.get(key) is not None}
    for key in ("stop_token_ids",):
        if key in given and not isinstance(given[key], list):
            raise ProtocolError(f"{key} must be a list of token ids", key)
    params = SamplingParams(max_tokens=max_tokens, stop=tuple(stop), logprobs=logprobs, logit_bias=_logit_bias(body),
                            **given)
    try:
        params.validate(max_model_len=max_tokens + 1, prompt_len=1, vocab_size=vocab_size)
    except RequestError as exc:
        raise ProtocolError(str(exc), _param_of(str(exc), logprobs_name)) from None
    return Options(params, n, stream, bool(stream_options.get("include_usage")), return_token_ids)


def _param_of(message: str, logprobs_name: str) -> str | None:
    """The request parameter a SamplingParams message is about (its messages open with the field's name)."""
    first = message.split(" ", 1)[0]
    if first == "logprobs":
        return logprobs_name
    if first in ("max_tokens", *_SAMPLING_KEYS):
        return first
    if "stop token id" in message:
        return "stop_token_ids"
    if first == "logit_bias":
        return "logit_bias"
    return "stop" if "stop string" in message else None


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise ProtocolError(f"at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or (
                message["role"] not in MESSAGE_ROLES):
            raise ProtocolError(f"{where} must be an object whose role is one of {', '.join(sorted(MESSAGE_ROLES))}",
                                f"{where}.role")
        message = dict(message)
        message["content"] = _text_content(message.get("content"), where, message["role"])
        tool_calls = message.get("tool_calls") or []
        if not isinstance(tool_calls, list):
            raise ProtocolError(f"{where}.tool_calls must be a list of tool calls", f"{where}.tool_calls")
        for call_index, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            try:
                decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                decoded = None
            if not isinstance(function.get("name") if isinstance(function, dict) else None, str) or not isinstance(
                    decoded, dict):
                raise ProtocolError(f"{where}.tool_calls[{call_index}] needs function.name and function.arguments "
                                    "(a JSON object)", f"{where}.tool_calls")
        checked.append(message)
    return checked


def _text_content(content, where: str, role: str) -> str | None:
    """A message's content as text: a string, or text parts joined; other parts (images, audio) are refused."""
    if content is None:
        if role in ("assistant",):
            return None
        raise ProtocolError(f"{where}.content is missing", f"{where}.content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    texts = []
    for part_index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ProtocolError(
                f"{where}.content[{part_index}] is of type {excerpt(kind)}: only text parts are supported (the engine "
                "serves text; image and audio inputs are not)", f"{where}.content[{part_index}].type")
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ProtocolError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not isinstance(
                function.get("name"), str) or not isinstance(function.get("parameters", {}), dict):
            raise ProtocolError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                "\"parameters\": {...}}}}", f"tools[{index}]")
    return tools


def _tool_choice(choice, tools: list[dict]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ProtocolError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get(
        "type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise ProtocolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', "tool_choice")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ProtocolError(f"tool_choice names {excerpt(name)}, which is not among the tools", "tool_choice")
    return "required", name
