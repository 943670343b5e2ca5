"""The checkpoint's chat template (`chat_template` in tokenizer_config.json, or chat_template.jinja), rendered by
transformers' own `apply_chat_template`."""

from __future__ import annotations

import json

from hybridkv.sidecar.core.sampling import RequestError


class ChatTemplateError(RequestError):
    """A conversation the template cannot render (or a checkpoint without a template), with the reason."""


class ChatTemplate:
    def __init__(self, folder: str):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(folder)
        self.folder = folder

    @property
    def available(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def render(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> str:
        """The prompt text, ending with the assistant turn's opening; raises ChatTemplateError with the reason."""
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
