"""A chat completion's text split into reasoning, content and tool calls, whole or as a stream of OpenAI deltas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from hybridkv.sidecar.serving.openai.reasoning import THINK_CLOSE, THINK_OPEN, partial_tag_length, split_reasoning
from hybridkv.sidecar.serving.openai.tool_calls import CALL_OPEN, ToolCallText, parse_tool_calls


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
    """Feeds text deltas and returns what is new as one OpenAI chat delta: at every feed, what `parse_chat_output`
    of the whole text so far adds to the fields already sent, without reading that whole text again. A reasoning
    model's reply can run to tens of thousands of tokens, and a front door streaming hundreds of them would otherwise
    re-parse (and copy) each reply once per token. So the reasoning is searched for its close only where the new
    text could complete it, and only the reasoning not yet sent is held; after it, content without a tool parser is
    passed on as it comes; with a tool parser, only the text from the first call's tag on is re-parsed."""

    def __init__(self, parsing: OutputParsing):
        self.parsing = parsing
        reasoning = parsing.reasoning_parser is not None
        # "head": whether the output opens `<think>` is not known yet; "reasoning": inside it; "content": after it.
        self._phase = "content" if not reasoning else "reasoning" if parsing.starts_in_reasoning else "head"
        self._unread = parsing.assistant_prefix  # text fed with the first delta
        self._head = ""
        self._body = ""  # the reasoning not yet sent (leading newlines dropped before any is sent)
        self._reasoning_sent = False
        # With a tool parser: the content not yet sent while no call has begun (a tag cut by the token boundary and
        # trailing whitespace wait); from the first `<tool_call>` on, the text from there (what `parse_tool_calls`
        # reads), the unsent content before it, and how much content had been sent when it began.
        self._plain = ""
        self._calls_text: str | None = None
        self._before_calls = ""
        self._sent_before_calls = 0
        self._content_leading = False  # newlines at the content's start are layout: dropped until other text
        self._reasoning_chars = 0
        self._content_chars = 0
        self._call_ids: list[str] = []
        self._argument_chars: list[int] = []
        self.has_tool_calls = False

    def feed(self, text_delta: str, final: bool) -> dict:
        text, self._unread = self._unread + text_delta, ""
        delta: dict = {}
        reasoning, content = "", ""
        if self._phase == "head":
            text = self._decide_head(self._head + text, final)
        if self._phase == "reasoning":
            reasoning, text = self._reasoning(text, final)
        if self._phase == "content":
            content = self._content_text(text)
        if reasoning:
            delta["reasoning_content"] = reasoning
            self._reasoning_chars += len(reasoning)
        if self.parsing.tool_parser is None:
            if content:
                delta["content"] = content
                self._content_chars += len(content)
            return delta
        content, tool_calls = self._tool_content(content, final)
        if content:
            delta["content"] = content
            self._content_chars += len(content)
        calls = []
        for index, call in enumerate(tool_calls):
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

    def _decide_head(self, head: str, final: bool) -> str:
        """While the output may still open `<think>`, holds it; returns the text the phase it turns out to be
        takes (`split_reasoning`'s rule: only whitespace before the tag)."""
        stripped = head.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._phase = "reasoning"
            return stripped[len(THINK_OPEN):]
        if not final and THINK_OPEN.startswith(stripped):
            self._head = head
            return ""
        self._phase = "content"  # no reasoning: the whole output, as written, is content
        return head

    def _reasoning(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning `text` adds that can be sent, and the text past the reasoning's close (its content)."""
        searched = max(0, len(self._body) - len(THINK_CLOSE) + 1)
        self._body += text
        if not self._reasoning_sent:
            self._body = self._body.lstrip("\n")
            searched = 0
        close = self._body.find(THINK_CLOSE, searched)
        if close >= 0:
            reasoning, after = self._body[:close].rstrip("\n"), self._body[close + len(THINK_CLOSE):]
            self._body, self._phase, self._content_leading = "", "content", True
            return reasoning, after
        if final:  # the output ended inside its reasoning (a length limit, or a model that never closed it)
            reasoning, self._body = self._body.rstrip("\n"), ""
            return reasoning, ""
        # A tag cut by the token boundary, and newlines that may be the ones before the close, wait.
        held = partial_tag_length(self._body, (THINK_CLOSE,))
        reasoning = self._body[:len(self._body) - held].rstrip("\n")
        self._body = self._body[len(reasoning):]
        self._reasoning_sent = self._reasoning_sent or bool(reasoning)
        return reasoning, ""

    def _tool_content(self, text: str, final: bool) -> tuple[str, tuple]:
        """The content `text` adds that can be sent, and the calls so far, as `parse_tool_calls` of the whole
        content gives them: until a call begins, only the unsent tail is looked at; from there, only the text from
        the first call's tag is parsed (what comes before it is plain content)."""
        if self._calls_text is None:
            searched = max(0, len(self._plain) - len(CALL_OPEN) + 1)
            self._plain += text
            start = self._plain.find(CALL_OPEN, searched)
            if start < 0:
                if final:  # no call at all: the content as written
                    sendable = self._plain
                else:  # a tag cut by the token boundary, and whitespace that may precede a call, wait
                    held = partial_tag_length(self._plain, (CALL_OPEN,))
                    sendable = self._plain[:len(self._plain) - held].rstrip()
                self._plain = self._plain[len(sendable):]
                return sendable, ()
            self._before_calls, self._calls_text, self._plain = self._plain[:start], self._plain[start:], ""
            self._sent_before_calls = self._content_chars
        else:
            self._calls_text += text
        parsed = parse_tool_calls(self.parsing.tool_parser, self._calls_text, self.parsing.tools, final)
        # The whole content is (before + calls' content) right-stripped when there are calls or the stream goes on,
        # and what was sent before the calls ends in other than whitespace.
        if parsed.content or not (parsed.calls or not final):
            unsent = self._before_calls + parsed.content
        else:
            unsent = self._before_calls.rstrip()
        return unsent[self._content_chars - self._sent_before_calls:], parsed.calls

    def _content_text(self, text: str) -> str:
        if self._content_leading:
            text = text.lstrip("\n")
            self._content_leading = not text
        return text
