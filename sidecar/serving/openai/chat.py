"""The checkpoint's chat template (`chat_template` in tokenizer_config.json, or chat_template.jinja), rendered by
transformers' own `apply_chat_template`."""

from __future__ import annotations

import json
import os

from hybridkv.sidecar.core.sampling import RequestError


class ChatTemplateError(RequestError):
    """A conversation the template cannot render (or a checkpoint without a template), with the reason."""


# A probe conversation: the generation prompt after its user turn, against the same turn answered and followed by
# another, as a client sends it back (a reply followed by a user turn is how every earlier reply is rendered).
_PROBE_USER, _PROBE_REPLY, _PROBE_NEXT = "hybridkv probe question", "hybridkv probe reply", "hybridkv probe follow-up"
_REPLY_TAILS_KEPT = 64  # distinct chat_template_kwargs whose reply tail is remembered


class ChatTemplate:
    def __init__(self, folder: str):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(folder)
        self.folder = folder
        self._reply_tails: dict[str, str] = {}

    @property
    def available(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def render(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> str:
        """The prompt text, ending with the assistant turn's opening (unless `template_kwargs` sets
        `add_generation_prompt` false); raises ChatTemplateError with the reason."""
        if not self.available:
            raise ChatTemplateError(
                f"the checkpoint {self.folder!r} has no chat template (`chat_template` in tokenizer_config.json or "
                "chat_template.jinja); send a raw prompt to /v1/completions instead")
        from jinja2 import TemplateError

        options = {"add_generation_prompt": True, **template_kwargs}
        try:
            return self._tokenizer.apply_chat_template(
                [_template_message(message) for message in messages], tools=tools or None, tokenize=False, **options)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {str(exc)[:300]}") from exc
        except (TypeError, ValueError) as exc:  # a template variable of a type the template cannot use
            raise ChatTemplateError(f"the chat template cannot render this request (check chat_template_kwargs): "
                                    f"{str(exc)[:300]}") from exc

    def reply_tail(self, template_kwargs: dict) -> str:
        """The end of a rendered prompt that the conversation's next turn does not render again: the part of the
        generation prompt after which the template writes an earlier reply differently (Qwen's opens `<think>`,
        which replies in the history do not repeat). Empty when the generation prompt is how replies start, or when
        the template cannot render the probe conversation (then nothing is assumed)."""
        key = json.dumps(template_kwargs, sort_keys=True, default=str)
        tail = self._reply_tails.get(key)
        if tail is None:
            tail = self._probe_reply_tail(template_kwargs)
            if len(self._reply_tails) < _REPLY_TAILS_KEPT:
                self._reply_tails[key] = tail
        return tail

    def _probe_reply_tail(self, template_kwargs: dict) -> str:
        asked = [{"role": "user", "content": _PROBE_USER}]
        answered = [*asked, {"role": "assistant", "content": _PROBE_REPLY}, {"role": "user", "content": _PROBE_NEXT}]
        try:
            prompt = self.render(asked, None, template_kwargs)
            history = self.render(answered, None, {**template_kwargs, "add_generation_prompt": False})
        except ChatTemplateError:
            return ""
        return prompt[len(os.path.commonprefix([prompt, history])):]


def _template_message(message: dict) -> dict:
    """Templates iterate a tool call's arguments as a mapping; OpenAI sends them JSON-encoded."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            function["arguments"] = json.loads(function["arguments"])
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}
