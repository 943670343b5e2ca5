"""Qwen3-style reasoning: the text inside `<think>...</think>` becomes `reasoning_content`, the rest `content`.

Qwen3.5/3.6 chat templates open `<think>` in the generation prompt when thinking is on, so the model's output starts
inside the reasoning and only closes it; with thinking off (or a template that leaves it to the model) the output may
open `<think>` itself. `starts_in_reasoning` says which: the server reads it off the rendered prompt.

`split_reasoning` is pure. With `final=False` (a stream in progress) it returns only what later text cannot change:
a tag cut by a token boundary, and newlines that may turn out to be the ones around a tag, are held back, so each
result is a prefix of every later one and streaming emits the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_PARSERS = ("qwen3",)


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str
    content: str
    # The reasoning was closed (or never opened): what follows is content.
    reasoning_done: bool


def partial_tag_length(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (a tag cut mid-way)."""
    longest = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:length]):
                longest = length
                break
    return longest


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The rendered prompt ends inside an open `<think>` (the template started the reasoning)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def split_reasoning(text: str, starts_in_reasoning: bool, final: bool) -> ReasoningSplit:
    body = text
    if not starts_in_reasoning:
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            body = stripped[len(THINK_OPEN):]
        elif not final and THINK_OPEN.startswith(stripped):
            return ReasoningSplit("", "", False)  # may still become `<think>`
        else:
            return ReasoningSplit("", text, True)
    close = body.find(THINK_CLOSE)
    if close < 0:
        if final:  # the output ended inside its reasoning (a length limit, or a model that never closed it)
            return ReasoningSplit(body.strip("\n"), "", False)
        held = partial_tag_length(body, (THINK_CLOSE,))
        reasoning = body[:len(body) - held].lstrip("\n").rstrip("\n")
        return ReasoningSplit(reasoning, "", False)
    reasoning = body[:close].strip("\n")
    # The newlines after `</think>` are the template's layout, not content.
    return ReasoningSplit(reasoning, body[close + len(THINK_CLOSE):].lstrip("\n"), True)
