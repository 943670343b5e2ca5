"""The reasoning and tool-call parsers of the OpenAI front door: whole outputs, every split point while streaming,
and malformed model output (pure functions, no server)."""

from __future__ import annotations

import json

import pytest

from hybridkv.sidecar.serving.openai.output import ChatOutputStream, OutputParsing, parse_chat_output
from hybridkv.sidecar.serving.openai.reasoning import prompt_opens_reasoning, split_reasoning
from hybridkv.sidecar.serving.openai.tool_calls import forced_prefix, parse_tool_calls

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}}]

HERMES_TWO_CALLS = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Oslo"}}\n</tool_call>')
XML_TWO_CALLS = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[6, 18]"
                 "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                 "Lima\n</parameter>\n</function>\n</tool_call>")


def _stream(parsing: OutputParsing, text: str, cuts: list[int]) -> dict:
    """Feeds `text` cut at `cuts` and folds the deltas back into whole fields, as a client would."""
    stream = ChatOutputStream(parsing)
    reasoning, content, calls = "", "", {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for index, piece in enumerate(pieces):
        delta = stream.feed(piece, final=index == len(pieces) - 1)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"]["arguments"]
            if "id" in call:
                assert "id" not in entry, "a call's id is sent once"
                entry["id"] = call["id"]
    return {"reasoning": reasoning, "content": content,
            "calls": [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]}


def _whole(parsing: OutputParsing, text: str) -> dict:
    output = parse_chat_output(parsing, text, final=True)
    return {"reasoning": output.reasoning or "", "content": output.content,
            "calls": [(call.name, call.arguments) for call in output.tool_calls]}


def test_hermes_parses_parallel_calls_and_keeps_the_text_before_them():
    parsed = parse_tool_calls("hermes", HERMES_TWO_CALLS, WEATHER_TOOLS, final=True)
    assert parsed.content == "I will check both."
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Oslo"})]


def test_qwen3_coder_xml_converts_parameters_by_the_tool_schema():
    parsed = parse_tool_calls("qwen3_coder", XML_TWO_CALLS, WEATHER_TOOLS, final=True)
    assert parsed.content == "Checking."
    assert [json.loads(call.arguments) for call in parsed.calls] == [
        {"city": "São Paulo", "days": 3, "metric": True, "hours": [6, 18]}, {"city": "Lima"}]


@pytest.mark.parametrize("form, text", [("hermes", HERMES_TWO_CALLS), ("qwen3_coder", XML_TWO_CALLS)])
def test_streaming_at_every_split_point_adds_up_to_the_whole_parse(form, text):
    parsing = OutputParsing(tool_parser=form, tools=WEATHER_TOOLS)
    whole = _whole(parsing, text)
    for cut in range(1, len(text)):
        assert _stream(parsing, text, [cut]) == whole, cut
    # One character at a time: every tag is cut at every position.
    assert _stream(parsing, text, list(range(1, len(text)))) == whole


def test_streamed_xml_arguments_grow_by_whole_parameters_and_the_name_comes_first():
    parsing = OutputParsing(tool_parser="qwen3_coder", tools=WEATHER_TOOLS)
    stream = ChatOutputStream(parsing)
    first_call = XML_TWO_CALLS[:XML_TWO_CALLS.index("</function>")]
    seen = []
    for char in first_call:
        delta = stream.feed(char, final=False)
        seen.extend(delta.get("tool_calls", ()))
    assert seen[0]["function"]["name"] == "get_weather" and seen[0]["function"]["arguments"] == "{"
    # Each later delta is one whole parameter, never a partial value.
    assert [call["function"]["arguments"] for call in seen[1:]] == [
        '"city": "São Paulo"', ', "days": 3', ', "metric": true', ', "hours": [6, 18]']


@pytest.mark.parametrize("form, text", [
    ("hermes", 'Before <tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> after'),
    ("hermes", "<tool_call>\n[1, 2, 3]\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\nno function tag here\n</tool_call>"),
    ("hermes", "a lone </tool_call> and <tool_ca"),
])
def test_malformed_calls_stay_in_the_content_as_written(form, text):
    parsed = parse_tool_calls(form, text, WEATHER_TOOLS, final=True)
    assert parsed.calls == ()
    assert parsed.content == text


def test_an_unclosed_call_at_the_end_of_the_output_is_still_a_call_if_it_parses():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    [call] = parse_tool_calls("hermes", text, WEATHER_TOOLS, final=True).calls
    assert json.loads(call.arguments) == {"city": "Rome"}
    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    [call] = parse_tool_calls("qwen3_coder", xml, WEATHER_TOOLS, final=True).calls
    assert json.loads(call.arguments) == {"city": "Rome"}


def test_text_that_only_looks_like_a_tag_start_is_released_as_content():
    parsing = OutputParsing(tool_parser="hermes", tools=WEATHER_TOOLS)
    assert _stream(parsing, "a < b and <tool is not a call", [3, 11, 15]) == {
        "reasoning": "", "content": "a < b and <tool is not a call", "calls": []}


REASONED = "\nThe user wants a number.\nPick 4.\n</think>\n\nThe answer is 4."


def test_reasoning_opened_by_the_prompt_is_split_out():
    split = split_reasoning(REASONED, starts_in_reasoning=True, final=True)
    assert (split.reasoning, split.content) == ("The user wants a number.\nPick 4.", "The answer is 4.")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_opened_by_the_model_and_no_reasoning_at_all():
    split = split_reasoning("<think>\nhmm\n</think>\n\nYes.", starts_in_reasoning=False, final=True)
    assert (split.reasoning, split.content) == ("hmm", "Yes.")
    split = split_reasoning("Just an answer.", starts_in_reasoning=False, final=True)
    assert (split.reasoning, split.content) == ("", "Just an answer.")


def test_reasoning_cut_by_the_length_limit_stays_reasoning():
    split = split_reasoning("\nstill thinking about", starts_in_reasoning=True, final=True)
    assert (split.reasoning, split.content, split.reasoning_done) == ("still thinking about", "", False)


@pytest.mark.parametrize("starts_in_reasoning, text", [(True, REASONED), (False, "<think>\nhmm\n</think>\n\nYes.")])
def test_streamed_reasoning_at_every_split_point_adds_up_to_the_whole(starts_in_reasoning, text):
    parsing = OutputParsing(reasoning_parser="qwen3", starts_in_reasoning=starts_in_reasoning)
    whole = _whole(parsing, text)
    for cut in range(1, len(text)):
        assert _stream(parsing, text, [cut]) == whole, cut
    assert _stream(parsing, text, list(range(1, len(text)))) == whole


def test_reasoning_then_a_tool_call_then_a_forced_call_prefix():
    parsing = OutputParsing(reasoning_parser="qwen3", tool_parser="hermes", tools=WEATHER_TOOLS,
                            starts_in_reasoning=True)
    text = ('Need weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
    whole = _whole(parsing, text)
    assert whole == {"reasoning": "Need weather.", "content": "",
                     "calls": [("get_weather", '{"city": "Paris"}')]}
    assert _stream(parsing, text, list(range(1, len(text)))) == whole
    # tool_choice naming the function: the server writes the call's opening, the model the arguments.
    prefix = "</think>\n\n" + forced_prefix("hermes", "get_weather")
    forced = OutputParsing(reasoning_parser="qwen3", tool_parser="hermes", tools=WEATHER_TOOLS,
                           starts_in_reasoning=True, assistant_prefix=prefix)
    assert _whole(forced, '{"city": "Oslo"}}\n</tool_call>')["calls"] == [("get_weather", '{"city": "Oslo"}')]
    xml_prefix = forced_prefix("qwen3_coder", "get_weather")
    xml = OutputParsing(tool_parser="qwen3_coder", tools=WEATHER_TOOLS, assistant_prefix=xml_prefix)
    assert _whole(xml, "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")["calls"] == [
        ("get_weather", '{"days": 2}')]


class _WholeTextStream:
    """The specification of `ChatOutputStream`: every feed parses the whole text so far (`parse_chat_output`) and
    sends what it adds to each field."""

    def __init__(self, parsing: OutputParsing):
        self.parsing, self.text, self.sent = parsing, "", {"reasoning": 0, "content": 0}
        self.arguments: list[int] = []

    def feed(self, text_delta: str, final: bool) -> dict:
        self.text += text_delta
        output = parse_chat_output(self.parsing, self.text, final)
        delta = {}
        for field, value in (("reasoning", output.reasoning or ""), ("content", output.content)):
            if len(value) > self.sent[field]:
                delta[field] = value[self.sent[field]:]
                self.sent[field] = len(value)
        for index, call in enumerate(output.tool_calls):
            if index == len(self.arguments):
                self.arguments.append(len(call.arguments))
                delta.setdefault("calls", []).append((index, call.name, call.arguments))
            elif len(call.arguments) > self.arguments[index]:
                delta.setdefault("calls", []).append((index, None, call.arguments[self.arguments[index]:]))
                self.arguments[index] = len(call.arguments)
        return delta


def _comparable(delta: dict) -> dict:
    """A `ChatOutputStream` delta in `_WholeTextStream`'s terms (call ids are random)."""
    out = {}
    if "reasoning_content" in delta:
        out["reasoning"] = delta["reasoning_content"]
    if "content" in delta:
        out["content"] = delta["content"]
    if "tool_calls" in delta:
        out["calls"] = [(call["index"], call["function"].get("name"), call["function"]["arguments"])
                        for call in delta["tool_calls"]]
    return out


PIECES = ("\n", "\n\n", " ", "<think>", "</think>", "</thi", "nk>", "<", "hello", " world", "<tool_call>",
          '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>", "<function=get_weather>",
          "<parameter=city>\nRome\n</parameter>", "</function>", "x")


@pytest.mark.parametrize("reasoning_parser, starts_in_reasoning, tool_parser, prefix", [
    (None, False, None, ""), ("qwen3", True, None, ""), ("qwen3", False, None, ""), ("qwen3", True, "hermes", ""),
    ("qwen3", False, "qwen3_coder", ""), (None, False, "hermes", ""), ("qwen3", True, None, "\n"),
    ("qwen3", True, "hermes", "</think>\n\n" + forced_prefix("hermes", "get_weather")),
    (None, False, "qwen3_coder", forced_prefix("qwen3_coder", "get_weather"))])
def test_each_streamed_delta_is_what_the_whole_text_parse_adds(reasoning_parser, starts_in_reasoning, tool_parser,
                                                               prefix):
    """Random outputs of tags, newlines and words, cut at random points: every feed sends exactly what re-parsing
    the whole text so far would add."""
    import random

    parsing = OutputParsing(reasoning_parser=reasoning_parser, tool_parser=tool_parser, tools=WEATHER_TOOLS,
                            starts_in_reasoning=starts_in_reasoning, assistant_prefix=prefix)
    rng = random.Random(f"{reasoning_parser}{starts_in_reasoning}{tool_parser}{prefix}")
    for _ in range(150):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 14)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 8)))) if text else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, spec = ChatOutputStream(parsing), _WholeTextStream(parsing)
        for index, piece in enumerate(pieces):
            final = index == len(pieces) - 1
            assert _comparable(stream.feed(piece, final)) == spec.feed(piece, final), (text, cuts, index)


def test_a_long_reasoning_stream_holds_only_what_it_has_not_sent():
    """Tens of thousands of tokens of reasoning: what the stream keeps stays as short as a held-back tag, and the
    close is still found when it comes split over two deltas."""
    stream = ChatOutputStream(OutputParsing(reasoning_parser="qwen3", starts_in_reasoning=True))
    sent = []
    for _ in range(20_000):
        sent.append(stream.feed("word\n", final=False).get("reasoning_content", ""))
        assert len(stream._body) <= len("\n")
    sent.append(stream.feed("done</th", final=False).get("reasoning_content", ""))
    assert stream.feed("ink>\n\nAnswer.", final=True) == {"content": "Answer."}
    assert "".join(sent) == "word\n" * 19_999 + "word\ndone"


def test_a_long_answer_with_tools_offered_holds_only_what_it_has_not_sent():
    """A long plain answer with a tool parser on: only a possible tag start and trailing whitespace wait, and a
    call that comes after it still parses (only the text from its tag is re-read)."""
    stream = ChatOutputStream(OutputParsing(tool_parser="hermes", tools=WEATHER_TOOLS))
    sent = []
    for _ in range(20_000):
        sent.append(stream.feed("word \n", final=False).get("content", ""))
        assert len(stream._plain) <= len(" \n")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    name, arguments = "", ""
    for index, piece in enumerate((call[:5], call[5:40], call[40:])):
        delta = stream.feed(piece, final=index == 2)
        sent.append(delta.get("content", ""))
        for streamed in delta.get("tool_calls", ()):
            name += streamed["function"].get("name", "")
            arguments += streamed["function"]["arguments"]
    assert "".join(sent) == ("word \n" * 20_000).rstrip()
    assert (name, arguments) == ("get_weather", '{"city": "Oslo"}')
    assert len(stream._calls_text) == len(call)
