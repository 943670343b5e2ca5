"""Tool calls in the model's text, parsed into OpenAI `tool_calls` (chosen with `--tool-call-parser`).

- `hermes`: JSON inside tags, as Qwen3 templates ask for:
  `<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>`.
- `qwen3_coder`: the XML form of Qwen3.5/3.6 (and Qwen3-Coder):
  `<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>`; parameter values are text,
  converted to the JSON type the tool's schema declares.

`parse_tool_calls(form, text, tools, final)` is pure. With `final=False` (a stream in progress) every field it returns
is a prefix of what it returns for any longer text: a tag cut by a token boundary is held back, a call's name appears
once complete, and its arguments grow only by whole parameters (XML) or all at once when the call closes (JSON).
A block that does not parse stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from hybridkv.sidecar.serving.openai.reasoning import partial_tag_length

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
_JSON_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ToolCallText:
    name: str
    arguments: str  # JSON text of an object; while streaming, a prefix of it
    complete: bool


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str
    calls: tuple[ToolCallText, ...]


def forced_prefix(form: str, function_name: str | None) -> str:
    """Assistant text that commits the model to a tool call (`tool_choice` required), to this function if named."""
    if form == "hermes":
        return CALL_OPEN + "\n" + ("" if function_name is None else '{"name": ' + json.dumps(function_name)
                                   + ', "arguments": ')
    return CALL_OPEN + "\n" + ("" if function_name is None else f"{FUNCTION_OPEN}{function_name}>\n")


def parse_tool_calls(form: str, text: str, tools: list[dict], final: bool) -> ParsedToolCalls:
    parse_block = _parse_json_block if form == "hermes" else _parse_xml_block
    content, calls, position = [], [], 0
    while True:
        start = text.find(CALL_OPEN, position)
        if start < 0:
            tail = text[position:]
            if not final:
                tail = tail[:len(tail) - partial_tag_length(tail, (CALL_OPEN,))]
            content.append(tail)
            break
        content.append(text[position:start])
        end = text.find(CALL_CLOSE, start)
        block = text[start + len(CALL_OPEN):] if end < 0 else text[start + len(CALL_OPEN):end]
        call = parse_block(block, tools, complete=end >= 0 or final)
        if end < 0 and not final:  # the call is still being written
            if call is not None:
                calls.append(call)
            break
        if call is None or not call.complete:
            content.append(text[start:] if end < 0 else text[start:end + len(CALL_CLOSE)])
        else:
            calls.append(call)
        if end < 0:
            break
        position = end + len(CALL_CLOSE)
    joined = "".join(content)
    if calls or not final:
        # Whitespace around calls is layout; while streaming, trailing whitespace may still precede a call.
        joined = joined.rstrip()
    return ParsedToolCalls(joined, tuple(calls))


def _parse_json_block(block: str, tools: list[dict], complete: bool) -> ToolCallText | None:
    if not complete:
        match = _JSON_NAME.search(block)
        return None if match is None else ToolCallText(json.loads(f'"{match.group(1)}"'), "", False)
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCallText(call["name"], json.dumps(arguments, ensure_ascii=False), True)


def _parse_xml_block(block: str, tools: list[dict], complete: bool) -> ToolCallText | None:
    function = _FUNCTION.search(block)
    if function is None:
        return None
    name = function.group(1).strip()
    body_start = function.end()
    close = block.find(FUNCTION_CLOSE, body_start)
    body = block[body_start:] if close < 0 else block[body_start:close]
    schema = _parameter_schemas(tools, name)
    pieces = [f"{json.dumps(key.strip())}: {json.dumps(_convert(value, schema.get(key.strip())), ensure_ascii=False)}"
              for key, value in _PARAMETER.findall(body)]
    arguments = "{" + ", ".join(pieces)
    if close >= 0 or complete:
        return ToolCallText(name, arguments + "}", True)
    return ToolCallText(name, arguments, False)


def _parameter_schemas(tools: list[dict], name: str) -> dict:
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def _convert(raw: str, schema: dict | None):
    """A parameter's text as the JSON value its schema's type asks for; text when no schema says otherwise or the
    text does not parse as that type."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    kind = (schema or {}).get("type", "string")
    if kind == "string" or isinstance(kind, list) and "string" in kind:
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    expected = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
                "null": type(None)}.get(kind)
    return parsed if expected is None or isinstance(parsed, expected) else value
