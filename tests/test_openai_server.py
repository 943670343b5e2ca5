"""The OpenAI-compatible HTTP front door driven by the real `openai` client, on loopback, against the tiny CPU engine.

One sidecar serves both doors over one Frontend and one engine; the tests compare what HTTP returns with what gRPC
`Generate` returns for the same request. Tool calls and reasoning, which a random model never writes, go through the
whole HTTP path from `ScriptedFrontend`: the Frontend interface replaying a fixed model output token by token, so
tags are cut at token boundaries. The sidecar and the scripted servers are shared by the module.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from prometheus_client import CollectorRegistry  # noqa: E402

from hybridkv.api.client import GenerationClient  # noqa: E402
from hybridkv.net import free_loopback_port  # noqa: E402
from hybridkv.sidecar.core.sampling import validate_request  # noqa: E402

MODEL_NAME = "tiny-qwen3.5"
TOKEN = "s3cret-http-token"
MAX_NUM_SEQS = 4
MAX_QUEUE = 2
MAX_MODEL_LEN = 256
PROMPT = "The token pool is split into blocks"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
POLL_LIMIT_S = 30.0


def _engine_config(model_dir):
    from hybridkv.sidecar.core.config import EngineConfig

    return EngineConfig(model=str(model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                        max_num_batched_tokens=512, kv_cache_memory_bytes=8 * 1024**2, device="cpu")


def _server_config(**overrides):
    from hybridkv.sidecar.serving.server import ServerConfig

    settings = dict(host="127.0.0.1", port=0, metrics_port=0, http_port=free_loopback_port(), max_queue=MAX_QUEUE,
                    auth_token=TOKEN, served_model_name=MODEL_NAME, tool_call_parser="hermes",
                    reasoning_parser="qwen3")
    settings.update(overrides)
    return ServerConfig(**settings)


class ScriptedFrontend:
    """The serving Frontend's interface, with `script` as the model's output, one token per output."""

    script = ""

    def __init__(self, tokenizer, model_info: dict):
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.ready = True
        self.draining = False
        self.stats = None
        self.last_prompt_ids: list[int] | None = None
        self.capacity, self.max_queue = {"state_slots": 8}, 8  # the admission limit the HTTP door checks

    async def generate(self, request_id, prompt, params):
        from hybridkv.sidecar.core.outputs import RequestOutput

        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.last_prompt_ids = prompt_ids
        validate_request(request_id, prompt_ids, params, self.model_info["max_model_len"],
                         self.model_info["vocab_size"])
        token_ids = self.tokenizer.encode(self.script)
        text_so_far = ""
        for count in range(1, len(token_ids) + 1):
            finished = count == len(token_ids)
            text = self.tokenizer.decode(token_ids[:count])
            # As the engine does, a character cut between tokens waits for its last byte.
            delta = "" if text.endswith("\ufffd") and not finished else text[len(text_so_far):]
            yield RequestOutput(request_id, token_ids[count - 1:count], delta, finished,
                                "stop" if finished else None, len(prompt_ids), count)
            text_so_far += delta
            await asyncio.sleep(0)


class _Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    return make_model(tmp_path_factory.mktemp(MODEL_NAME), catalog_geometry("qwen3.5-4b"), seed=7, tiny=True)


@pytest.fixture(scope="module")
def sidecar(model_dir):
    from hybridkv.sidecar.serving.server import BackgroundServer

    background = BackgroundServer(_engine_config(model_dir), _server_config()).start().load()
    yield background
    background.close()


@pytest.fixture(scope="module")
def grpc_client(sidecar):
    with GenerationClient(sidecar.target, token=TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def servers(sidecar, model_dir):
    """{name: (frontend, port)}: the sidecar's HTTP door, and a scripted server per tool-call form."""
    from hybridkv.sidecar.serving.openai.app import HttpServer, HttpSettings, build_app
    from hybridkv.sidecar.serving.openai.chat import ChatTemplate

    loop = _Loop()
    template = ChatTemplate(str(model_dir))
    frontend = sidecar.server.frontend
    # The scripted servers run no engine: their limit leaves room for the tools' system prompt.
    info = {**frontend.model_info, "max_model_len": 4096}
    scripted = {}
    for form in ("hermes", "qwen3_coder"):
        settings = HttpSettings(MODEL_NAME, tool_call_parser=form, reasoning_parser="qwen3")
        scripted_frontend = ScriptedFrontend(frontend.tokenizer, info)
        server = HttpServer(build_app(scripted_frontend, settings, CollectorRegistry(), template), "127.0.0.1", 0)
        loop.call(server.start())
        scripted[form] = (scripted_frontend, server)
    yield {"engine": (frontend, sidecar.server.http_port),
           **{form: (scripted_frontend, server.port) for form, (scripted_frontend, server) in scripted.items()}}
    for _, server in scripted.values():
        loop.call(server.stop())
    loop.close()


def _client(servers, name="engine", token=TOKEN):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{servers[name][1]}/v1", api_key=token or "none", max_retries=0)


def _grpc(grpc_client, prompt, **options):
    token_ids, text, logprobs, last = [], [], [], None
    for response in grpc_client.generate(prompt, **options):
        token_ids.extend(response.token_ids)
        text.append(response.text)
        logprobs.extend(response.logprobs)
        last = response
    return token_ids, "".join(text), logprobs, last


def _wait_idle(grpc_client) -> None:
    deadline_s = time.monotonic() + POLL_LIMIT_S
    while any((usage := grpc_client.get_capacity()["usage"])[key] for key in ("used_token_blocks", "used_state_slots",
                                                                            "running", "waiting")):
        assert time.monotonic() < deadline_s, f"the engine kept a request after its client left: {usage}"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------ equal to gRPC Generate


def test_completion_text_and_tokens_equal_grpc_generate(servers, grpc_client):
    client = _client(servers)
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    token_ids, text, _, last = _grpc(grpc_client, PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    [choice] = completion.choices
    assert choice.text == text and choice.token_ids == token_ids
    assert choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == last.usage.prompt_tokens
    assert completion.usage.completion_tokens == 12 == completion.usage.total_tokens - completion.usage.prompt_tokens
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(streamed)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == text
    assert [t for chunk in chunks if chunk.choices for t in chunk.choices[0].token_ids] == token_ids
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_both_doors_report_the_prompt_tokens_taken_from_the_prefix_cache(model_dir):
    """A server with prefix caching: a 140-token prompt, then the same prompt with more tokens, through each door.
    The second finds the first's prompt-end checkpoint (at its last 64-token chunk start, 128): gRPC's
    `usage.cached_tokens` and the OpenAI usage's `prompt_tokens_details.cached_tokens` both say 128."""
    from dataclasses import replace

    from hybridkv.sidecar.serving.server import BackgroundServer

    # Room for every checkpoint the requests make (the default, half of 4 state slots, keeps only the latest two).
    config = replace(_engine_config(model_dir), enable_prefix_caching=True, prefix_checkpoint_slots=4)
    background = BackgroundServer(config, _server_config()).start().load()
    try:
        prompt = [(31 * i) % 400 + 7 for i in range(140)]
        with GenerationClient(background.target, token=TOKEN) as client:
            for ids, cached in ((prompt, 0), (prompt + [5, 6, 7], 128)):
                *_, last = _grpc(client, ids, max_tokens=4, temperature=0.0, ignore_eos=True)
                assert last.usage.cached_tokens == cached
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{background.server.http_port}/v1", api_key=TOKEN,
                             max_retries=0)
        completion = http.completions.create(model=MODEL_NAME, prompt=prompt + [8, 9], max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert completion.usage.prompt_tokens_details.cached_tokens == 128
        assert completion.usage.prompt_tokens == 142
    finally:
        background.close()


def test_the_template_names_the_generation_prompt_tail_a_reply_loses(model_dir):
    """Qwen's template opens `<think>` in the generation prompt, and renders an earlier reply without it."""
    from hybridkv.sidecar.serving.openai.chat import ChatTemplate

    template = ChatTemplate(str(model_dir))
    assert template.reply_tail({}) == "<think>\n"
    assert template.reply_tail({"enable_thinking": False}) == "<think>\n\n</think>\n\n"


def test_a_chat_client_re_rendering_the_history_resumes_from_the_previous_prompt(model_dir):
    """Turn two through the chat endpoint sends turn one's reply back as a message, which the template renders
    without the `<think>` the generation prompt opened (its last 2 tokens): turn two resumes from turn one's
    prompt-end checkpoint, at the last block boundary before that tail. Turn one's prompt is sized so its own last
    boundary falls inside the tail, and steps of 16 tokens end on every boundary, so a checkpoint there would be
    past where turn two parts from it and nothing would be found."""
    from dataclasses import replace

    from hybridkv.sidecar.serving.server import BackgroundServer

    def conversation(rules: int) -> list[dict]:
        return [{"role": "system", "content": " ".join(f"rule {i}." for i in range(rules))},
                {"role": "user", "content": PROMPT}]

    messages = next(conversation(rules) for rules in range(10, 40)
                    if len(_rendered_chat_ids(model_dir, conversation(rules))) % 16 < 2)
    prompt_tokens = len(_rendered_chat_ids(model_dir, messages))
    config = replace(_engine_config(model_dir), enable_prefix_caching=True, prefix_checkpoint_slots=4,
                     max_num_batched_tokens=16)
    background = BackgroundServer(config, _server_config()).start().load()
    try:
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{background.server.http_port}/v1", api_key=TOKEN,
                             max_retries=0)
        first = http.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert first.usage.prompt_tokens == prompt_tokens
        reply = first.choices[0].message
        messages += [{"role": "assistant", "content": reply.content or reply.reasoning_content},
                     {"role": "user", "content": "And then?"}]
        second = http.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert second.usage.prompt_tokens_details.cached_tokens == prompt_tokens // 16 * 16 - 16 > 0
    finally:
        background.close()


def test_grpc_clients_rendering_a_template_pass_the_tail_themselves(model_dir):
    """The same re-rendered turn over gRPC ids: with `resume_tail_tokens` the next turn resumes before the tail
    (steps of 16 tokens end on each boundary: 96 of a 113-token prompt with a 3-token tail, whose own last boundary,
    112, holds a token of the tail), and a tail that is not shorter than the prompt is refused with the reason."""
    from dataclasses import replace

    import grpc

    from hybridkv.sidecar.serving.server import BackgroundServer

    config = replace(_engine_config(model_dir), enable_prefix_caching=True, prefix_checkpoint_slots=4,
                     max_num_batched_tokens=16)
    background = BackgroundServer(config, _server_config()).start().load()
    try:
        prompt = [(37 * i) % 400 + 7 for i in range(110)] + [1, 2, 3]  # the last three: the template's tail
        with GenerationClient(background.target, token=TOKEN) as client:
            token_ids, _, _, _ = _grpc(client, prompt, max_tokens=4, temperature=0.0, ignore_eos=True,
                                       resume_tail_tokens=3)
            next_turn = prompt[:-3] + [(t + 1) % 400 for t in token_ids] + [9, 8, 7]
            *_, last = _grpc(client, next_turn, max_tokens=2, temperature=0.0, ignore_eos=True,
                             resume_tail_tokens=3)
            assert last.usage.cached_tokens == 96
            with pytest.raises(grpc.RpcError) as refused:
                _grpc(client, [1, 2, 3], max_tokens=2, resume_tail_tokens=3)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "resume_tail_tokens" in refused.value.details()
    finally:
        background.close()


def test_sampling_with_penalties_min_p_and_a_seed_equals_grpc(servers, grpc_client):
    sampling = dict(temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.8, frequency_penalty=0.5)
    extra = dict(top_k=40, min_p=0.02, repetition_penalty=1.3)
    completion = _client(servers).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, **sampling,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    token_ids, text, _, _ = _grpc(grpc_client, PROMPT, max_tokens=24, ignore_eos=True, **sampling, **extra)
    assert completion.choices[0].token_ids == token_ids
    assert completion.choices[0].text == text
    # The penalties change the output: without them the same seed draws other tokens.
    plain, _, _, _ = _grpc(grpc_client, PROMPT, max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95,
                           seed=1234)
    assert plain != token_ids


def test_logit_bias_through_both_doors(servers, grpc_client):
    """OpenAI's logit_bias (token ids as JSON keys): +100 makes a token the only choice, -100 bans the greedy one;
    the gRPC map gives the same tokens."""
    client = _client(servers)
    forced = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={"17": 100},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert forced.choices[0].token_ids == [17] * 6
    plain, _, _, _ = _grpc(grpc_client, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(plain[0]): -100},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert banned.choices[0].token_ids[0] != plain[0] and plain[0] not in banned.choices[0].token_ids
    by_grpc, _, _, _ = _grpc(grpc_client, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True,
                             logit_bias={plain[0]: -100.0})
    assert by_grpc == banned.choices[0].token_ids
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logit_bias={"23": 100},
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.choices[0].token_ids == [23] * 3


def test_min_tokens_holds_back_stop_ids_through_both_doors(servers, grpc_client):
    """vLLM's min_tokens: a stop token id the greedy output would start with is not sampled for the first tokens."""
    plain, _, _, _ = _grpc(grpc_client, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    stopped, _, _, last = _grpc(grpc_client, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True,
                                stop_token_ids=[plain[0]])
    assert stopped == [plain[0]]
    held, _, _, _ = _grpc(grpc_client, PROMPT, max_tokens=6, min_tokens=3, temperature=0.0, ignore_eos=True,
                          stop_token_ids=[plain[0]])
    assert len(held) >= 3 and plain[0] not in held[:3]
    completion = _client(servers).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "min_tokens": 3, "stop_token_ids": [plain[0]]})
    assert completion.choices[0].token_ids == held


def test_n_choices_are_seeded_requests_of_their_own(servers, grpc_client):
    completion = _client(servers).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=50,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        token_ids, _, _, _ = _grpc(grpc_client, PROMPT, max_tokens=8, temperature=1.0, seed=50 + choice.index,
                                   ignore_eos=True)
        assert choice.token_ids == token_ids
    assert len({tuple(choice.token_ids) for choice in completion.choices}) > 1
    assert completion.usage.completion_tokens == 24
    assert completion.usage.prompt_tokens == len(servers["engine"][0].tokenizer.encode(PROMPT))


def test_logprobs_equal_grpc_on_both_endpoints(servers, grpc_client):
    client = _client(servers)
    token_ids, _, logprobs, _ = _grpc(grpc_client, PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True,
                                      logprobs=2)
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    got = completion.choices[0].logprobs
    assert got.token_logprobs == [entry.logprob for entry in logprobs]
    decode = servers["engine"][0].tokenizer.decode
    assert got.tokens == [decode([token_id]) for token_id in token_ids]
    # The legacy format keys alternatives by their text, so two tokens that decode alike share one key.
    assert got.top_logprobs == [{decode([t.token_id]): t.logprob for t in entry.top} for entry in logprobs]
    # Greedy: the chosen token is the most likely one.
    assert all(entry.top[0].token_id == token_id for entry, token_id in zip(logprobs, token_ids))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob == entry.top_logprobs[0].logprob for entry in content)


def test_stop_sequence_cuts_the_text_and_finishes_with_stop(servers, grpc_client):
    _, text, _, _ = _grpc(grpc_client, PROMPT, max_tokens=30, temperature=0.0, ignore_eos=True)
    stop = text[10:13]
    assert stop.strip(), text
    completion = _client(servers).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0,
                                                     stop=[stop], extra_body={"ignore_eos": True})
    assert completion.choices[0].text == text[:text.index(stop)]
    assert completion.choices[0].finish_reason == "stop"
    kept = _client(servers).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0,
                                               stop=[stop],
                                               extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"
    _, by_grpc, _, _ = _grpc(grpc_client, PROMPT, max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop],
                             include_stop_str_in_output=True)
    assert by_grpc == kept.choices[0].text


def _rendered_chat_ids(model_dir, messages, tools=None, **kwargs) -> list[int]:
    from hybridkv.sidecar.model.tokenizer import Tokenizer
    from hybridkv.sidecar.serving.openai.chat import ChatTemplate

    return Tokenizer(str(model_dir)).encode(ChatTemplate(str(model_dir)).render(messages, tools, kwargs))


def test_chat_renders_the_checkpoints_template_and_equals_grpc(servers, grpc_client, model_dir):
    client = _client(servers)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True, "return_token_ids": True}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                          extra_body=no_thinking)
    prompt_ids = _rendered_chat_ids(model_dir, messages, enable_thinking=False)
    token_ids, text, _, last = _grpc(grpc_client, prompt_ids, max_tokens=10, temperature=0.0, ignore_eos=True)
    [choice] = chat.choices
    assert choice.token_ids == token_ids
    assert choice.message.role == "assistant" and choice.message.content == text
    assert chat.usage.prompt_tokens == len(prompt_ids) == last.usage.prompt_tokens
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                                   stream=True, extra_body=no_thinking))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == text
    assert streamed[-1].choices[0].finish_reason == "length"
    # Thinking on (the template opens <think>): a random model never closes it, so all of it is reasoning.
    thinking = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                              extra_body={"ignore_eos": True})
    thinking_ids = _rendered_chat_ids(model_dir, messages)
    _, thinking_text, _, _ = _grpc(grpc_client, thinking_ids, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert thinking.choices[0].message.reasoning_content == thinking_text.strip("\n")
    assert thinking.choices[0].message.content == ""


def test_chat_without_max_tokens_may_run_to_the_model_length(servers):
    chat = _client(servers).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], temperature=0, stop=["e"],
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens <= MAX_MODEL_LEN


def test_a_client_that_leaves_mid_stream_frees_its_engine_request(servers, grpc_client):
    stream = _client(servers).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=200, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    usage = grpc_client.get_capacity()["usage"]
    assert usage["used_state_slots"] == 1 and usage["used_token_blocks"] >= 1
    stream.close()
    _wait_idle(grpc_client)
    # A non-streamed request whose client gives up is aborted too (its 240 tokens take ~0.5 s on a CPU: the client
    # leaves well before).
    with pytest.raises(openai.APITimeoutError):
        _client(servers).with_options(timeout=0.1).completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=240, temperature=0, extra_body={"ignore_eos": True})
    _wait_idle(grpc_client)


# ------------------------------------------------------------------------------------------ tools and reasoning

HERMES_CALLS = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")


def _scripted(servers, name, script):
    frontend, _ = servers[name]
    frontend.script = script
    return _client(servers, name, token=None), frontend


def _chat(client, **options):
    options.setdefault("extra_body", {"chat_template_kwargs": {"enable_thinking": False}})
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}],
                                          tools=[WEATHER_TOOL], **options)


def test_parallel_tool_calls_in_the_json_form(servers):
    client, frontend = _scripted(servers, "hermes", HERMES_CALLS)
    chat = _chat(client)
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking both."
    assert [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Oslo"})]
    assert len({call.id for call in message.tool_calls}) == 2
    # The tools reached the template.
    assert '"name": "get_weather"' in frontend.tokenizer.decode(frontend.last_prompt_ids)


def test_a_single_xml_tool_call_streamed_token_by_token(servers):
    client, _ = _scripted(servers, "qwen3_coder", XML_CALL)
    chunks = list(_chat(client, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": "", "ids": []})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
            entry["ids"] += [call.id] if call.id else []
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and len(calls[0]["ids"]) == 1
    assert json.loads(calls[0]["arguments"]) == {"city": "São Paulo", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    # Arguments arrived in more than one piece: streamed as the parameters completed.
    assert sum(bool(chunk.choices[0].delta.tool_calls) for chunk in chunks) >= 3


def test_a_named_tool_choice_writes_the_calls_opening_into_the_prompt(servers):
    client, frontend = _scripted(servers, "hermes", '{"city": "Rome"}}\n</tool_call>')
    chat = _chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body={})
    [call] = chat.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    prompt = frontend.tokenizer.decode(frontend.last_prompt_ids)
    assert prompt.endswith('</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ')


def test_tool_choice_none_leaves_tool_text_as_content(servers):
    client, frontend = _scripted(servers, "hermes", HERMES_CALLS)
    chat = _chat(client, tool_choice="none")
    assert chat.choices[0].message.content == HERMES_CALLS and not chat.choices[0].message.tool_calls
    assert "get_weather" not in frontend.tokenizer.decode(frontend.last_prompt_ids)


REASONING = "\nThe user asks for a number; 4 will do.\n</think>\n\nFour."


def test_reasoning_is_split_out_whole_and_streamed(servers):
    client, _ = _scripted(servers, "hermes", REASONING)
    messages = [{"role": "user", "content": "A number?"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages)
    assert chat.choices[0].message.reasoning_content == "The user asks for a number; 4 will do."
    assert chat.choices[0].message.content == "Four."
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True))
    reasoning = "".join(getattr(chunk.choices[0].delta, "reasoning_content", None) or "" for chunk in chunks)
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert (reasoning, content) == ("The user asks for a number; 4 will do.", "Four.")
    assert sum(bool(getattr(chunk.choices[0].delta, "reasoning_content", None)) for chunk in chunks) > 3


# ------------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": PROMPT, "presence_penalty": 9}, "presence_penalty"),
    ("completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": PROMPT, "best_of": 3}, "best_of"),
    ("completions", {"prompt": PROMPT, "stop": ["x" * 300]}, "stop"),
    ("completions", {"prompt": PROMPT, "frobnicate": True}, "frobnicate"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0].type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    # Values of the wrong JSON type where the parser used to index or hash them.
    ("chat/completions", {"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": {"a": 1}, "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]},
     "messages[0].tool_calls"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": ["search"]}, "tools[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [None]}, "tools[0]"),
    # Booleans and objects where a number or a boolean goes.
    ("completions", {"prompt": PROMPT, "temperature": True}, "temperature"),
    ("completions", {"prompt": PROMPT, "top_p": True}, "top_p"),
    ("completions", {"prompt": PROMPT, "ignore_eos": "yes"}, "ignore_eos"),
    ("completions", {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": "no"}},
     "stream_options"),
    ("completions", {"prompt": PROMPT, "repetition_penalty": 1e-300}, "repetition_penalty"),
    ("completions", {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("completions", {"prompt": PROMPT, "min_tokens": "3"}, "min_tokens"),
    ("completions", {"prompt": PROMPT, "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("completions", {"prompt": PROMPT, "logit_bias": [5, 1]}, "logit_bias"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"five": 1}}, "logit_bias"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"-5": 1}}, "logit_bias"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"1000000": 1}}, "logit_bias"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": "up"}}, "logit_bias"),
    # Limits the request could never meet, named by what the client sent.
    ("completions", {"prompt": ["a"] * 65}, "prompt"),
    ("completions", {"prompt": PROMPT, "n": MAX_NUM_SEQS + MAX_QUEUE + 1}, "n"),
    ("completions", {"prompt": [PROMPT] * (MAX_NUM_SEQS + MAX_QUEUE + 1)}, "prompt"),
    ("completions", {"prompt": PROMPT, "max_tokens": 10**6}, "max_tokens"),
    ("completions", {"prompt": [1, 10**6]}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 400}], "max_tokens": 4}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": 0},
     "chat_template_kwargs"),
    # Keywords of the renderer itself, not template variables.
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "chat_template_kwargs": {"conversation": []}}, "chat_template_kwargs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "chat_template_kwargs": {"return_assistant_tokens_mask": True}}, "chat_template_kwargs"),
])
def test_bad_parameters_get_400_naming_them(servers, endpoint, body, param):
    client = _client(servers)
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(f"/{endpoint}", body={"model": MODEL_NAME, **body}, cast_to=object)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body
    assert caught.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, content_type, reason", [
    (b'{"prompt": "hi", "max_tokens": 2}', "application/json; charset=bogus", None),  # JSON is UTF-8 whatever it says
    (b"[" * 100_000 + b"]" * 100_000, "application/json", "nests too deeply"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", "not valid JSON"),
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "application/json", "not valid Unicode"),
    (b'{"prompt": "\xff\xfe"}', "application/json", "not UTF-8"),
    (b"{", "application/json", "not valid JSON"),
], ids=["bogus-charset", "deep-nesting", "huge-integer", "lone-surrogate", "not-utf8", "truncated"])
def test_a_malformed_body_is_400_saying_why_and_the_server_serves_on(servers, body, content_type, reason):
    request = urllib.request.Request(f"http://127.0.0.1:{servers['engine'][1]}/v1/completions", data=body,
                                     headers={"Content-Type": content_type, "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, answer = response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, json.loads(exc.read())
    if reason is None:
        assert status == 200 and answer["choices"][0]["text"] is not None
    else:
        assert status == 400 and reason in answer["error"]["message"], answer
    assert _client(servers).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices


def _post(servers, path: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{servers['engine'][1]}{path}", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenize_renders_as_the_chat_endpoint_and_detokenize_inverts_it(servers, model_dir):
    tokenizer = servers["engine"][0].tokenizer
    status, answer = _post(servers, "/tokenize", {"model": MODEL_NAME, "prompt": PROMPT})
    assert status == 200 and answer["tokens"] == tokenizer.encode(PROMPT) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    status, answer = _post(servers, "/tokenize", {"messages": messages,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and answer["tokens"] == _rendered_chat_ids(model_dir, messages, enable_thinking=False)
    # The same rendering the chat endpoint sends to the engine: its usage counts the same prompt tokens.
    chat = _client(servers).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0,
                                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.usage.prompt_tokens == answer["count"]
    status, without = _post(servers, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and without["count"] < answer["count"]
    status, text = _post(servers, "/detokenize", {"tokens": tokenizer.encode(PROMPT)})
    assert status == 200 and text == {"prompt": PROMPT}


@pytest.mark.parametrize("path, payload, param", [
    ("/tokenize", {"prompt": PROMPT, "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": PROMPT, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": "yes"},
     "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ("/tokenize", {"prompt": PROMPT, "add_special_tokens": True}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": []}, "tokens"),
    ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, "tokens"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
], ids=["both", "neither", "empty", "chat-option-with-prompt", "not-a-bool", "reserved-kwarg", "unknown-key",
        "negative-id", "outside-vocab", "no-ids", "too-many", "not-a-list"])
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_parameter(servers, path, payload, param):
    status, answer = _post(servers, path, payload)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_a_prompt_past_the_model_length_is_400_with_the_reason(servers):
    with pytest.raises(openai.BadRequestError) as caught:
        _client(servers).completions.create(model=MODEL_NAME, prompt=[5] * MAX_MODEL_LEN, max_tokens=4)
    assert "exceeds max_model_len" in caught.value.body["message"]


def test_ignored_parameters_are_accepted(servers):
    completion = _client(servers).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, user="u-1",
                                                     extra_body={"metadata": {"k": "v"}, "store": False,
                                                                 "service_tier": "auto"})
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_another_model_name_is_404(servers):
    with pytest.raises(openai.NotFoundError) as caught:
        _client(servers).completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert caught.value.body["param"] == "model" and MODEL_NAME in caught.value.body["message"]


def test_a_full_queue_is_429_with_retry_after(servers, grpc_client):
    limit = MAX_NUM_SEQS + MAX_QUEUE
    streams = [grpc_client.generate(PROMPT, max_tokens=240, temperature=0.0, ignore_eos=True) for _ in range(limit)]
    frontend = servers["engine"][0]
    try:
        deadline_s = time.monotonic() + POLL_LIMIT_S
        while frontend.in_flight < limit:
            assert time.monotonic() < deadline_s, f"only {frontend.in_flight} of {limit} requests got in flight"
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as caught:
            _client(servers).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    finally:
        for stream in streams:
            stream.cancel()
    retry_after_ms = int(caught.value.response.headers["retry-after-ms"])
    assert retry_after_ms > 0
    assert int(caught.value.response.headers["Retry-After"]) == -(-retry_after_ms // 1000)
    assert "queue full" in caught.value.body["message"]
    _wait_idle(grpc_client)


def test_a_sidecar_still_loading_answers_503_and_health_says_so(model_dir):
    from hybridkv.sidecar.serving.server import BackgroundServer

    loading = BackgroundServer(_engine_config(model_dir), _server_config()).start()
    try:
        port = loading.server.http_port
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
        assert caught.value.status_code == 503 and "loading" in caught.value.body["message"]
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.value.code == 503
    finally:
        loading.close()


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_the_api_needs_the_bearer_token_but_health_and_metrics_do_not(servers, token):
    client = _client(servers, token=token)
    for call in (client.models.list, lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                                                       max_tokens=2)):
        with pytest.raises(openai.AuthenticationError) as caught:
            call()
        assert caught.value.status_code == 401
    port = servers["engine"][1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert f'vllm:num_requests_waiting{{model_name="{MODEL_NAME}"}}' in response.read().decode()


def test_the_template_is_read_from_tokenizer_config_and_its_absence_is_a_clear_error(model_dir, tmp_path):
    from hybridkv.sidecar.random_checkpoint import CHAT_TEMPLATE
    from hybridkv.sidecar.serving.openai.chat import ChatTemplate, ChatTemplateError

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate(str(tmp_path)).render([{"role": "user", "content": "hi"}], None, {})
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    rendered = ChatTemplate(str(tmp_path)).render([{"role": "user", "content": "hi"}], None, {})
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_models_lists_the_served_name(servers):
    [card] = _client(servers).models.list().data
    assert card.id == MODEL_NAME and card.owned_by == "hybridkv"
    assert card.max_model_len == MAX_MODEL_LEN


def test_a_server_defect_is_a_500_in_openais_shape_with_the_traceback_logged(caplog):
    """What no request could cause (here a frontend that raises) still answers JSON the SDKs read, not aiohttp's
    plain-text page, and the log keeps the traceback."""
    from aiohttp.test_utils import TestClient, TestServer

    from hybridkv.sidecar.serving.openai.app import HttpSettings, build_app

    class BrokenFrontend:
        draining = False

        @property
        def ready(self):
            raise RuntimeError("a defect")

    async def call():
        app = build_app(BrokenFrontend(), HttpSettings(MODEL_NAME), CollectorRegistry(), None)
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/v1/models")
            return response.status, await response.json()

    with caplog.at_level("ERROR", logger="hybridkv.sidecar.serving.openai.app"):
        status, body = asyncio.run(call())
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "GET /v1/models failed" in caplog.text and "RuntimeError: a defect" in caplog.text



def test_a_tiny_temperature_samples_greedily_and_a_tiny_top_p_keeps_the_top_token(servers):
    """Values that are positive but round to zero (or overflow the logits) in float32 on the device: a temperature
    below 1e-5 is greedy, as in vLLM, and a top_p below float32's range still keeps the most likely token."""
    client = _client(servers)
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    for options in ({"temperature": 1e-45}, {"temperature": 1e-300}, {"top_p": 1e-300, "temperature": 1.0}):
        completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, **options)
        assert completion.choices[0].text == greedy.choices[0].text, options


def test_an_authorization_header_that_is_not_utf8_is_a_401(servers):
    request = urllib.request.Request(f"http://127.0.0.1:{servers['engine'][1]}/v1/models",
                                     headers={"Authorization": "Bearer \xff\xfe"})  # sent as latin-1 bytes
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 401
    assert json.loads(caught.value.read())["error"]["type"] == "authentication_error"


def test_requests_aiohttp_cannot_parse_log_one_warning_not_a_traceback_each(servers, caplog):
    import socket

    with caplog.at_level("WARNING"):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", servers["engine"][1]), timeout=10) as conn:
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
                assert b" 400 " in conn.recv(100)
        deadline_s = time.monotonic() + POLL_LIMIT_S
        while "could not be parsed" not in caplog.text and time.monotonic() < deadline_s:
            time.sleep(0.05)
    assert "Traceback" not in caplog.text and "Error handling request" not in caplog.text
    assert caplog.text.count("could not be parsed") <= 1
