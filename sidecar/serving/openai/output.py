"""A chat completion's text split into reasoning, content and tool calls, whole or as a stream of OpenAI deltas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from hybridkv.sidecar.serving.openai.reasoning import split_reasoning
from hybridkv.sidecar.serving.openai.tool_calls import ToolCallText, parse_tool_calls


@dataclass(frozen=True)
class OutputParsing:
    """How one request's output is read: the parsers that apply, and the assistant text the server wrote into the
    prompt (a forced tool call, a closed reasoning) that belongs to the output as the parsers see it."""

    reasoning_parser: str | None = None
    tool_parser: str | None = None
    tools: list = field(default_factory=list)
    starts_in_reasoning: bool = False
    assistant_prefix: str = ""


@dataclass(frozen=True)
class ChatOutput:
    reasoning: str | None
    content: str
    tool_calls: tuple[ToolCallText, ...]


def parse_chat_output(parsing: OutputParsing, text: str, final: bool) -> ChatOutput:
    """Pure: with `final=False` each field is a prefix of what any longer text gives (see the parsers)."""
    text = parsing.assistant_prefix + text
    reasoning = None
    if parsing.reasoning_parser is not None:
        split = split_reasoning(text, parsing.starts_in_reasoning, final)
        reasoning, text = split.reasoning, split.content
    if parsing.tool_parser is None:
        return ChatOutput(reasoning, text, ())
    parsed = parse_tool_calls(parsing.tool_parser, text, parsing.tools, final)
    return ChatOutput(reasoning, parsed.content, parsed.calls)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutputStream:
    """Feeds text deltas through `parse_chat_output` and returns what is new as one OpenAI chat delta."""

    def __init__(self, parsing: OutputParsing):
        self.parsing = parsing
        self.text = ""
        self._reasoning_chars = 0
        self._content_chars = 0
        self._call_ids: list[str] = []
        self._argument_chars: list[int] = []
        self.has_tool_calls = False

    def feed(self, text_delta: str, final: bool) -> dict:
        self.text += text_delta
        output = parse_chat_output(self.parsing, self.text, final)
        delta: dict = {}
        if output.reasoning and len(output.reasoning) > self._reasoning_chars:
            delta["reasoning_content"] = output.reasoning[self._reasoning_chars:]
            self._reasoning_chars = len(output.reasoning)
        if len(output.content) > self._content_chars:
            delta["content"] = output.content[self._content_chars:]
            self._content_chars = len(output.content)
        calls = []
        for index, call in enumerate(output.tool_calls):
            if index == len(self._call_ids):
                self._call_ids.append(new_tool_call_id())
                self._argument_chars.append(len(call.arguments))
                calls.append({"index": index, "id": self._call_ids[index], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self._argument_chars[index]:
                calls.append({"index": index, "function": {"arguments": call.arguments[self._argument_chars[index]:]}})
                self._argument_chars[index] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
            self.has_tool_calls = True
        return delta
