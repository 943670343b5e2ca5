#!/usr/bin/env python3
"""Serving benchmark: seeded synthetic or traced traffic against a server, closed-loop or Poisson, read against the
sum of the engine's own parts.

Workloads (--workload). Every draw comes from one random.Random(--seed) (default 3) in a fixed order, so the same
flags give the same requests on every target:
  random    per request: the prompt length int(lognormvariate(--prompt-mu, --prompt-sigma)) clipped to
            [--prompt-min, --prompt-max] (default 6.0, 0.9, 16-4000: median about 400, mean about 600), then the
            output length uniform in [--output-min, --output-max] (default 32-256), then the prompt's token ids,
            uniform in the vocabulary. Equal min and max give one fixed length.
  chat      --requests / --turns conversations of --turns turns behind one system prompt of --system-tokens tokens
            shared by all. A turn's prompt is the system prompt, every earlier message with the reply the server
            actually gave to it, then the turn's new message (its length drawn as a random prompt's, then the output
            length, then the ids). A conversation's turns run one after another.
  document  --documents documents of --document-tokens tokens (drawn first); each request asks one of them (drawn
            uniformly) a question (length, output length, ids as above): the prompt is the document, then the question.
  trace     the JSONL file --trace, one request per line (at most --requests lines are read):
              {"prompt_ids": [1, 2, 3], "output_tokens": 64}          token ids as given
              {"prompt_tokens": 512, "output_tokens": 64, "arrival_s": 0.25}   ids drawn from the seed
            "arrival_s" (seconds after the phase starts, non-decreasing) is used by --request-rate trace.
Every request is greedy with ignore_eos, so it produces exactly its output length. Before each phase --warmup
requests (16 prompt tokens, 4 output tokens) run one at a time, unmeasured.

Schedules: --concurrency 64,256 runs one closed-loop phase per value (that many requests, or conversations, in
flight; the next starts when one finishes). --request-rate 4,8 runs open-loop phases: requests (or conversations)
arrive as a Poisson process at that rate, drawn from random.Random(--seed) apart from the workload, with at most
--max-concurrency in flight; --request-rate trace replays the trace's arrival_s. --rounds repeats each phase and
pools the rounds.

Targets: --target grpc://HOST:PORT (a running sidecar), --target http://HOST:PORT (an OpenAI-style server: streaming
POST /v1/completions with token-id prompts; the chat shape needs `choices[0].token_ids` in its events), or
--serve-args "FLAGS" to start `hybridkv serve FLAGS` on a free loopback port for the run; the server's CPU per output
token (its process and the engine process, from /proc) is then reported too, and the lines it logged at WARNING or
above (a kernel compiled after ready names itself there) are printed after the run and kept in the JSON;
--server-log FILE keeps its whole log. --compare-in-process (with --serve-args,
closed-loop phases) also runs each round on the engine driven from this process, alternating with the server, and
reports the server's overhead on median inter-token time and CPU per output token. On a GPU both engines share the
device: give --kv-cache-memory (and --gpu-memory-utilization) in --serve-args so that both fit.

Prefix caching (the server's default; --no-enable-prefix-caching in --serve-args runs the phase without, to compare):
each phase reports the prompt tokens the server found in its prefix cache, in all and per checkpoint kind
(prompt_end, inside_prompt, output_end), read from the server's Prometheus counters (--metrics-url for --target),
against what a cache with no size limit could have hit on the same traffic: whole blocks of a prompt that an
earlier request's prompt (once its first token came) or prompt and reply (once it ended) held, short of the prompt's
last token. The client cannot see a prompt's blocks before its first token, so a server that shares them while the
prompt is still prefilling can pass that figure by a little.

Engine steps: from the same counters, each phase reports the server engine's steps by kind (decode: decodes only,
the CUDA-graph path; mixed: decodes and prefill chunks; prefill), their mean time, and the share of it the engine
spent waiting for the device: near 100% the device set the pace, near 0% the host did (launching, scheduling,
outputs).

Figures per phase: requests/s (completed), total tok/s ((prompt + output tokens) / wall time of the phase), output
tok/s; TTFT, TPOT ((last token - first token) / (output tokens - 1)), ITL (a message of k tokens after a gap g counts
as k gaps of g/k) and end-to-end latency, each p50/p90/p99 by nearest rank; goodput, the requests/s that met every
SLO given (--slo-ttft-ms, --slo-tpot-ms); the first-shape stall check: each request's TTFT against the median TTFT of
its prompt-length bucket [2^k, 2^(k+1)), the worst ratio (at most 2 passes; queueing hides stalls, so read it at
concurrency 1); with --metrics-url (or --serve-args), the kernels the server compiled during the phase, which is the
direct reading of a first-shape stall at any concurrency.

Sum-of-parts bound, with --prefill-tok-s and --decode-step-ms, or --parts FILE (a bench/throughput.py result: its
highest prefill rate, and its decode step time interpolated at the phase's decode batch; the flags override it): the
phase's prompt tokens at the prefill rate plus its decode steps (output tokens after the first of each request,
divided by the decode batch: the concurrency, the mean requests in flight for open-loop phases, at most the server's
max_num_seqs) at the step time. Each throughput figure is given as a fraction of the bound's, each latency figure as
a multiple of the bound's (a request's ideal TTFT is its prompt at the prefill rate; TPOT and ITL one step).

    python bench/serving.py --serve-args "--model DIR --device cuda --max-num-seqs 256 --max-model-len 8192" \\
        --requests 512 --concurrency 64,256 --parts throughput.json
    hybridkv make-model --catalog qwen3.5-4b --dtype bfloat16 --config-only --out DIR   # config and tokenizer only
    python bench/serving.py --serve-args "--model DIR --load-format random --max-num-seqs 256" --concurrency 64
    python bench/serving.py --target grpc://10.0.0.5:50051 --workload chat --requests 64 --turns 4 \\
        --system-tokens 1024 --request-rate 2,4 --slo-ttft-ms 500 --slo-tpot-ms 40
    python bench/serving.py --serve-args "--model DIR --device cpu --max-num-seqs 32 --max-model-len 256" \\
        --prompt-min 32 --prompt-max 32 --output-min 48 --output-max 48 --requests 96 --concurrency 32 \\
        --compare-in-process --rounds 3
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from hybridkv.errors import UserError
from hybridkv.sidecar.core.outputs import STEP_KINDS

MAX_REQUESTS = 100_000
MAX_PROMPT_TOKENS = 1 << 20
MAX_OUTPUT_TOKENS = 1 << 20
MAX_TRACE_LINE_BYTES = 64 << 20
QUANTILES = (0.5, 0.9, 0.99)
STALL_RATIO = 2.0
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 4
CHAT_WORDS = 26**3  # ids drawn for a chat target when it names no vocabulary: words of up to three letters
ERRORS_KEPT = 5


class BenchError(UserError):
    """A benchmark setting, trace or target that cannot work, with what to change."""


class TargetError(Exception):
    """One request failed at the target; the message says how (status and detail)."""


# ---------------------------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Turn:
    message_ids: tuple[int, ...]  # the tokens this turn adds to the conversation before its reply
    output_tokens: int


@dataclass(frozen=True)
class Conversation:
    """A sequence of requests that share a prefix; a single request is a conversation of one turn."""
    prefix_ids: tuple[int, ...]
    turns: tuple[Turn, ...]
    arrival_s: float | None = None

    def tokens_needed(self) -> int:
        """Prompt plus output tokens of the last turn: the longest request of the conversation."""
        return len(self.prefix_ids) + sum(len(turn.message_ids) + turn.output_tokens for turn in self.turns)


@dataclass(frozen=True)
class Lengths:
    prompt_mu: float = 6.0
    prompt_sigma: float = 0.9
    prompt_min: int = 16
    prompt_max: int = 4000
    output_min: int = 32
    output_max: int = 256

    def validate(self) -> None:
        if not 1 <= self.prompt_min <= self.prompt_max <= MAX_PROMPT_TOKENS:
            raise BenchError(f"need 1 <= --prompt-min <= --prompt-max <= {MAX_PROMPT_TOKENS}, "
                             f"got {self.prompt_min} and {self.prompt_max}")
        if not 1 <= self.output_min <= self.output_max <= MAX_OUTPUT_TOKENS:
            raise BenchError(f"need 1 <= --output-min <= --output-max <= {MAX_OUTPUT_TOKENS}, "
                             f"got {self.output_min} and {self.output_max}")
        if not (math.isfinite(self.prompt_mu) and math.isfinite(self.prompt_sigma) and 0 <= self.prompt_sigma <= 10):
            raise BenchError("--prompt-mu must be finite and --prompt-sigma in [0, 10]")

    def turn(self, rng: random.Random, vocab_size: int) -> Turn:
        prompt_tokens = min(self.prompt_max, max(self.prompt_min, int(rng.lognormvariate(self.prompt_mu,
                                                                                          self.prompt_sigma))))
        output_tokens = rng.randint(self.output_min, self.output_max)
        return Turn(random_ids(rng, prompt_tokens, vocab_size), output_tokens)


def random_ids(rng: random.Random, count: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(count))


def random_workload(requests: int, lengths: Lengths, vocab_size: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [Conversation((), (lengths.turn(rng, vocab_size),)) for _ in range(requests)]


def chat_workload(requests: int, turns: int, system_tokens: int, lengths: Lengths, vocab_size: int,
                  seed: int) -> list[Conversation]:
    if requests % turns:
        raise BenchError(f"--requests ({requests}) must be a multiple of --turns ({turns}) for the chat workload")
    rng = random.Random(seed)
    system_ids = random_ids(rng, system_tokens, vocab_size)
    return [Conversation(system_ids, tuple(lengths.turn(rng, vocab_size) for _ in range(turns)))
            for _ in range(requests // turns)]


def document_workload(requests: int, documents: int, document_tokens: int, lengths: Lengths, vocab_size: int,
                      seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    texts = [random_ids(rng, document_tokens, vocab_size) for _ in range(documents)]
    workload = []
    for _ in range(requests):
        document = texts[rng.randrange(documents)]
        workload.append(Conversation(document, (lengths.turn(rng, vocab_size),)))
    return workload


def _trace_int(entry: dict, key: str, low: int, high: int, where: str) -> int:
    value = entry[key]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BenchError(f"{where}: {key!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


def read_trace(path: Path, requests: int, vocab_size: int | None, seed: int) -> list[Conversation]:
    """Up to `requests` lines of a JSONL trace (format in the module docstring) as one-turn conversations."""
    rng = random.Random(seed)
    workload: list[Conversation] = []
    previous_arrival_s = 0.0
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise BenchError(f"--trace: cannot read {str(path)!r}: {exc.strerror}") from exc
    with handle:
        for number, raw in enumerate(iter(lambda: handle.readline(MAX_TRACE_LINE_BYTES + 1), b""), start=1):
            where = f"{path}:{number}"
            if len(raw) > MAX_TRACE_LINE_BYTES:
                raise BenchError(f"{where}: line longer than {MAX_TRACE_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            if len(workload) == requests:
                break
            try:
                entry = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BenchError(f"{where}: not JSON ({exc})") from None
            if not isinstance(entry, dict):
                raise BenchError(f"{where}: each line must be a JSON object")
            unknown = set(entry) - {"prompt_ids", "prompt_tokens", "output_tokens", "arrival_s"}
            if unknown:
                raise BenchError(f"{where}: unknown keys {sorted(unknown)}")
            if ("prompt_ids" in entry) == ("prompt_tokens" in entry):
                raise BenchError(f"{where}: give exactly one of 'prompt_ids' and 'prompt_tokens'")
            if "output_tokens" not in entry:
                raise BenchError(f"{where}: 'output_tokens' is missing")
            output_tokens = _trace_int(entry, "output_tokens", 1, MAX_OUTPUT_TOKENS, where)
            if "prompt_ids" in entry:
                ids = entry["prompt_ids"]
                id_limit = (vocab_size or 2**32) - 1
                if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_PROMPT_TOKENS or not all(
                        isinstance(token, int) and not isinstance(token, bool) and 0 <= token <= id_limit
                        for token in ids):
                    raise BenchError(f"{where}: 'prompt_ids' must be 1 to {MAX_PROMPT_TOKENS} token ids in "
                                     f"[0, {id_limit}]")
                prompt_ids = tuple(ids)
            else:
                if vocab_size is None:
                    raise BenchError(f"{where}: 'prompt_tokens' needs the vocabulary size: give --vocab-size")
                prompt_ids = random_ids(rng, _trace_int(entry, "prompt_tokens", 1, MAX_PROMPT_TOKENS, where),
                                        vocab_size)
            arrival_s = None
            if "arrival_s" in entry:
                arrival_s = entry["arrival_s"]
                if (not isinstance(arrival_s, (int, float)) or isinstance(arrival_s, bool)
                        or not math.isfinite(arrival_s) or arrival_s < previous_arrival_s):
                    raise BenchError(f"{where}: 'arrival_s' must be a number of seconds, not below the previous "
                                     f"line's ({previous_arrival_s}), got {arrival_s!r}")
                previous_arrival_s = float(arrival_s)
            workload.append(Conversation((), (Turn(prompt_ids, output_tokens),), arrival_s))
    if not workload:
        raise BenchError(f"--trace: {str(path)!r} holds no requests")
    return workload


# ----------------------------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Phase:
    name: str
    concurrency: int | None  # closed loop: conversations in flight; open loop: the cap (None: no cap)
    arrivals_s: tuple[float, ...] | None = None  # open loop: when each conversation starts, after the phase start

    @property
    def closed_loop(self) -> bool:
        return self.arrivals_s is None


def poisson_arrivals(count: int, rate_per_s: float, seed: int) -> tuple[float, ...]:
    rng = random.Random(seed)
    arrivals, now_s = [], 0.0
    for _ in range(count):
        now_s += rng.expovariate(rate_per_s)
        arrivals.append(now_s)
    return tuple(arrivals)


# ------------------------------------------------------------------------------------------------------------ records


@dataclass
class RequestRecord:
    """What the client saw of one request: when it was sent, when each message with tokens came, when it ended."""
    prompt_tokens: int
    asked_output_tokens: int
    sent_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    done_s: float = 0.0
    error: str | None = None
    cached_tokens: int | None = None  # as the server's usage reported them
    server_ttft_s: float | None = None  # as the server's last response reported it

    def add_chunk(self, now_s: float, tokens: int) -> None:
        if tokens:
            self.chunk_times_s.append(now_s)
            self.chunk_tokens.append(tokens)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.sent_s

    @property
    def tpot_s(self) -> float:
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.output_tokens - 1)

    def itl_s(self) -> list[float]:
        gaps = []
        for previous_s, now_s, tokens in zip(self.chunk_times_s, self.chunk_times_s[1:], self.chunk_tokens[1:]):
            gaps.extend([(now_s - previous_s) / tokens] * tokens)
        return gaps


def warmup_prompt(vocab_size: int | None) -> tuple[int, ...]:
    return tuple(position % (vocab_size or WARMUP_PROMPT_TOKENS) for position in range(WARMUP_PROMPT_TOKENS))


# ------------------------------------------------------------------------------------------------------------ targets


class Chunk(NamedTuple):
    tokens: int
    token_ids: tuple[int, ...] | None  # None when the target streams text only
    text: str = ""  # the reply's text in this chunk, where the next turn's prompt is built from text
    prompt_tokens: int | None = None  # the prompt's length as the target counted it, where the target renders it
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache, where it says
    server_ttft_s: float | None = None  # the server's own time to first token, where it says (a request's last)


class Target(abc.ABC):
    """Where requests go. Subclasses stream one request's output as Chunks and raise TargetError on failure.

    A conversation's history is the target's to build: token ids here (each turn's prompt is the history so far),
    messages for a chat target, whose server renders them through its chat template."""

    name = "target"
    sees_prompt_ids = True  # the client knows each prompt's token ids (the unbounded prefix cache needs them)

    def open_history(self, prefix_ids: Sequence[int]) -> list:
        return list(prefix_ids)

    def add_message(self, history: list, message_ids: Sequence[int]) -> None:
        history.extend(message_ids)

    def reply_missing(self, reply_ids: list[int], reply_text: str, output_tokens: int) -> str | None:
        """Why the reply cannot extend the history, or None."""
        if len(reply_ids) != output_tokens:
            return "the target did not return the reply's token ids, which the next turn's prompt needs"
        return None

    def add_reply(self, history: list, reply_ids: list[int], reply_text: str) -> None:
        history.extend(reply_ids)

    async def calibrate(self) -> dict | None:
        """What a target that renders the prompt itself measures before the run so that the workload's lengths
        hold (OpenAIChatTarget: its tokens per word); None for targets that take token ids."""
        return None

    async def prompt_ids(self, history: Sequence) -> list[int]:
        """The token ids the server runs for `history` (a target that renders the prompt itself asks the server;
        TargetError if it cannot say)."""
        return list(history)

    async def __aenter__(self) -> Target:
        return self

    async def __aexit__(self, *exc_info) -> None:
        return None

    async def describe(self) -> dict:
        """What the target says about its model (vocab_size, max_model_len, max_num_seqs where it knows them)."""
        return {}

    @abc.abstractmethod
    def stream(self, history: Sequence, output_tokens: int) -> AsyncIterator[Chunk]:
        """One greedy request with ignore_eos on the history so far: its output as it arrives."""


class GrpcTarget(Target):
    name = "grpc"

    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self._timeout_s = timeout_s

    async def __aenter__(self) -> GrpcTarget:
        from hybridkv.api.client import AsyncGenerationClient

        self._client = AsyncGenerationClient(self.address)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._client.close()

    async def describe(self) -> dict:
        import grpc

        try:
            return await self._client.get_model_info(timeout_s=10.0)
        except grpc.aio.AioRpcError as exc:
            raise BenchError(f"--target grpc://{self.address}: GetModelInfo failed: {exc.code().name}: "
                             f"{exc.details()}") from None

    async def stream(self, prompt_ids: Sequence[int], output_tokens: int) -> AsyncIterator[Chunk]:
        import grpc

        try:
            async for response in self._client.generate(list(prompt_ids), max_tokens=output_tokens,
                                                        temperature=0.0, ignore_eos=True, timeout_s=self._timeout_s):
                server_ttft_s = response.times.time_to_first_token_s if response.HasField("times") else None
                if response.token_ids or server_ttft_s is not None:
                    yield Chunk(len(response.token_ids), tuple(response.token_ids),
                                cached_tokens=response.usage.cached_tokens, server_ttft_s=server_ttft_s)
        except grpc.aio.AioRpcError as exc:
            raise TargetError(f"{exc.code().name}: {exc.details()}") from None


class OpenAIHttpTarget(Target):
    """An OpenAI-style completions server: POST {base}/v1/completions with stream=true, read its SSE events."""

    name = "http"

    def __init__(self, base_url: str, served_model: str | None, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.served_model = served_model
        self._timeout_s = timeout_s

    async def __aenter__(self) -> OpenAIHttpTarget:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout_s))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._session.close()

    async def describe(self) -> dict:
        import aiohttp

        if self.served_model is not None:
            return {"name": self.served_model}
        try:
            async with self._session.get(f"{self.base_url}/v1/models") as response:
                listing = await response.json(content_type=None) if response.status == 200 else None
        except (aiohttp.ClientError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
            raise BenchError(f"--target {self.base_url}: GET /v1/models failed ({exc}); give --served-model") from None
        models = listing.get("data") if isinstance(listing, dict) else None
        if not models or not isinstance(models[0], dict) or not isinstance(models[0].get("id"), str):
            raise BenchError(f"--target {self.base_url}: GET /v1/models lists no model; give --served-model")
        self.served_model = models[0]["id"]
        return {"name": self.served_model}

    path = "/v1/completions"
    prompt_field = "prompt"  # where the history goes in the request body

    def _body(self, history: Sequence, output_tokens: int) -> dict:
        return {"model": self.served_model, self.prompt_field: list(history), "max_tokens": output_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}

    @staticmethod
    def _choice_text(choice: dict) -> str:
        return choice.get("text") or ""

    async def stream(self, history: Sequence, output_tokens: int) -> AsyncIterator[Chunk]:
        import aiohttp

        body = self._body(history, output_tokens)
        counted = 0
        try:
            async with self._session.post(f"{self.base_url}{self.path}", json=body) as response:
                if response.status != 200:
                    raise TargetError(f"HTTP {response.status}: {(await response.text())[:300]}")
                async for raw in response.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError:
                        raise TargetError(f"an event is not JSON: {data[:200]!r}") from None
                    if "error" in event:
                        raise TargetError(f"error event: {str(event['error'])[:300]}")
                    for choice in event.get("choices") or ():
                        token_ids = choice.get("token_ids")
                        text = self._choice_text(choice)
                        if token_ids:
                            counted += len(token_ids)
                            yield Chunk(len(token_ids), tuple(token_ids), text)
                        elif text:
                            counted += 1
                            yield Chunk(1, None, text)
                    # Without token ids a text event may hold several tokens; the final usage settles the count.
                    usage = event.get("usage") or {}
                    completion_tokens = usage.get("completion_tokens")
                    if isinstance(completion_tokens, int) and completion_tokens > counted:
                        yield Chunk(completion_tokens - counted, None)
                        counted = completion_tokens
                    if isinstance(usage.get("prompt_tokens"), int):
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                        yield Chunk(0, None, prompt_tokens=usage["prompt_tokens"],
                                    cached_tokens=cached if isinstance(cached, int) else None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise TargetError(f"HTTP request failed: {exc!r}") from None


# Common English nouns, the words of the chat messages: about one token each in a trained model's vocabulary. How
# many tokens they are is the server's tokenizer's to say; OpenAIChatTarget.calibrate measures it before the run.
MESSAGE_WORDS = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state",
    "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system",
    "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother",
    "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business",
    "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end",
    "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "body",
    "information", "back", "parent", "face", "level", "office", "door", "health", "person", "art", "war", "history",
    "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force",
    "education", "foot", "boy", "age", "policy", "music", "market", "sense", "nation", "plan", "college", "interest",
    "death", "experience", "effect", "use", "class", "control", "care", "field", "development", "role", "effort",
    "rate", "heart", "drug", "show", "leader", "light", "voice", "wife", "police", "mind", "price", "report",
    "decision", "son", "view", "relationship", "town", "road", "arm", "difference", "value", "building", "action",
    "model", "season", "society", "tax", "director", "position", "player", "record", "paper", "space", "ground",
    "form", "event", "official", "matter", "center", "couple", "site", "project", "activity", "star", "table",
    "need", "court", "oil", "situation", "cost", "industry", "figure", "street", "image", "phone", "data", "picture",
    "practice", "piece", "land", "product", "doctor", "wall", "patient", "worker", "news", "test", "movie", "north",
    "love", "support", "technology", "step", "baby", "computer", "type", "attention", "film", "tree", "source",
    "organization", "hair", "window", "evidence", "population", "truth", "song", "economy", "goal", "fire", "letter",
)


def words_of(ids: Sequence[int], tokens_per_word: float = 1.0) -> str:
    """Text for a chat message of len(ids) tokens: words of MESSAGE_WORDS chosen by the ids (the ids' draws stay the
    workload's on every target), as many as make len(ids) tokens at the server's `tokens_per_word`."""
    count = max(1, round(len(ids) / tokens_per_word)) if ids else 0
    return " ".join(MESSAGE_WORDS[ids[index % len(ids)] % len(MESSAGE_WORDS)] for index in range(count))


class OpenAIChatTarget(OpenAIHttpTarget):
    """An OpenAI-style chat server: POST {base}/v1/chat/completions with the conversation as messages, as chat
    clients send it: the system prompt, each user turn, and each earlier reply's content (not its reasoning) as an
    assistant message, which the server renders through its chat template and tokenizes anew every turn. Messages
    are words_of() the workload's ids, scaled by the server's tokens per word (`calibrate`) so that their token
    lengths are the workload's; prompt lengths are the server's usage counts."""

    name = "http-chat"
    path = "/v1/chat/completions"
    prompt_field = "messages"
    sees_prompt_ids = False  # the server renders the prompt
    tokens_per_word = 1.0
    CALIBRATION_WORDS = (8, 40)  # two message lengths: the difference of their prompts cancels the template's

    async def calibrate(self) -> dict:
        """Measure the server's tokens per word of MESSAGE_WORDS: the prompt tokens it counts for two one-message
        conversations of different lengths (one output token each, not part of any phase)."""
        import aiohttp

        counts = []
        for words in self.CALIBRATION_WORDS:
            body = {"model": self.served_model, "max_tokens": 1, "temperature": 0.0,
                    "messages": [{"role": "user", "content": words_of(range(words))}]}
            try:
                async with self._session.post(f"{self.base_url}{self.path}", json=body) as response:
                    if response.status != 200:
                        raise BenchError(f"--target {self.base_url}: the calibration request of {words} words got "
                                         f"HTTP {response.status}: {(await response.text())[:300]}")
                    reply = await response.json(content_type=None)
            except (aiohttp.ClientError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
                raise BenchError(f"--target {self.base_url}: the calibration request failed ({exc})") from None
            usage = reply.get("usage") if isinstance(reply, dict) else None
            if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
                raise BenchError(f"--target {self.base_url}: the calibration reply has no usage.prompt_tokens")
            counts.append(usage["prompt_tokens"])
        short, long = self.CALIBRATION_WORDS
        self.tokens_per_word = max(counts[1] - counts[0], 1) / (long - short)
        return {"tokens_per_word": self.tokens_per_word, "prompt_tokens": dict(zip(map(str, (short, long)), counts))}

    def open_history(self, prefix_ids: Sequence[int]) -> list:
        return [{"role": "system", "content": words_of(prefix_ids, self.tokens_per_word)}] if prefix_ids else []

    async def prompt_ids(self, history: Sequence) -> list[int]:
        """The rendered prompt's ids from the server's POST /tokenize (vLLM's endpoint; the same template,
        generation prompt included, that the chat endpoint renders)."""
        import aiohttp

        body = {"model": self.served_model, "messages": list(history)}
        try:
            async with self._session.post(f"{self.base_url}/tokenize", json=body) as response:
                if response.status != 200:
                    raise TargetError(f"POST /tokenize: HTTP {response.status}: {(await response.text())[:200]}")
                reply = await response.json(content_type=None)
        except (aiohttp.ClientError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
            raise TargetError(f"POST /tokenize failed ({exc!r})") from None
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(token, int) for token in tokens):
            raise TargetError("POST /tokenize answered without a list of token ids")
        return tokens

    def add_message(self, history: list, message_ids: Sequence[int]) -> None:
        history.append({"role": "user", "content": words_of(message_ids, self.tokens_per_word)})

    def reply_missing(self, reply_ids: list[int], reply_text: str, output_tokens: int) -> str | None:
        return None  # a reply of only reasoning, or of nothing but whitespace, is still a reply

    def add_reply(self, history: list, reply_ids: list[int], reply_text: str) -> None:
        history.append({"role": "assistant", "content": reply_text})

    @staticmethod
    def _choice_text(choice: dict) -> str:
        return (choice.get("delta") or {}).get("content") or ""


API_NAMES = ("completions", "chat")


def make_target(url: str, served_model: str | None, timeout_s: float, api: str = "completions") -> Target:
    scheme, _, rest = url.partition("://")
    if api not in API_NAMES:
        raise BenchError(f"--api must be one of {', '.join(API_NAMES)}, got {api!r}")
    if scheme == "grpc" and rest:
        if api != "completions":
            raise BenchError("--api chat needs an http(s):// target: gRPC Generate takes token ids")
        return GrpcTarget(rest, timeout_s)
    if scheme in ("http", "https") and rest:
        target = OpenAIChatTarget if api == "chat" else OpenAIHttpTarget
        return target(url, served_model, timeout_s)
    raise BenchError(f"--target must be grpc://HOST:PORT or http(s)://HOST:PORT, got {url!r}")


# ------------------------------------------------------------------------------------------------------------ drivers


class UnboundedPrefixCache:
    """What a prefix cache with no size limit could have hit, from what the client saw: a request's prompt is cached
    from its first token on, its prompt and reply from its end (all but the reply's last token, which the model never
    read); a request hits the longest run of whole blocks of its prompt cached when it is sent, short of its last
    prompt token, which the server always computes. (A server can share a prompt's blocks before its first token,
    which the client does not see, so it may hit a little more than this.)"""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.hit_tokens = 0
        self._keys: set[int] = set()

    def _chain(self, tokens: Sequence[int]):
        """(end, key) of every whole block of `tokens`; a block's key stands for all tokens up to its end."""
        key = 0
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            key = hash((key, tuple(tokens[end - self.block_size : end])))
            yield end, key

    def add(self, tokens: Sequence[int]) -> None:
        self._keys.update(key for _, key in self._chain(tokens))

    def add_reply(self, prompt: Sequence[int], reply: Sequence[int]) -> None:
        self.add([*prompt, *reply])

    def lookup(self, prompt: Sequence[int]) -> int:
        """The tokens `prompt` would hit now; `count` them once the request ran (one the server refused looked up
        nothing)."""
        hit = 0
        for end, key in self._chain(prompt[: len(prompt) - 1]):
            if key not in self._keys:
                break
            hit = end
        return hit

    def count(self, probe: int) -> None:
        self.hit_tokens += probe

    async def settle(self, target: Target) -> None:
        """Nothing to do: every figure is known as the phase runs."""


class RenderedPrefixCache:
    """The unbounded cache for a target that renders its prompts (the chat endpoint): a phase's lookups and additions
    are recorded with the history they were made on, in the order they happened, and replayed through an
    UnboundedPrefixCache once the phase is over, on the ids the server's POST /tokenize gives for each history
    (outside every request's timed span). `hit_tokens` is None when the server cannot tokenize."""

    def __init__(self, block_size: int):
        self._cache = UnboundedPrefixCache(block_size)
        self._events: list[tuple] = []  # (kind, history snapshot, reply ids or the lookup's index)
        self._counted: set[int] = set()
        self.hit_tokens: int | None = 0

    def lookup(self, history: Sequence) -> int:
        self._events.append(("lookup", tuple(history), len(self._events)))
        return len(self._events) - 1

    def count(self, probe: int) -> None:
        self._counted.add(probe)

    def add(self, history: Sequence) -> None:
        self._events.append(("add", tuple(history), ()))

    def add_reply(self, history: Sequence, reply: Sequence[int]) -> None:
        self._events.append(("add", tuple(history), tuple(reply)))

    async def settle(self, target: Target) -> None:
        histories = {_history_key(history): history for _, history, _ in self._events}
        gate = asyncio.Semaphore(8)

        async def tokenize(history) -> list[int]:
            async with gate:
                return await target.prompt_ids(history)

        try:
            ids = dict(zip(histories, await asyncio.gather(*(tokenize(h) for h in histories.values()))))
        except TargetError as exc:
            print(f"  the unbounded prefix cache is not computed: {exc}", flush=True)
            self.hit_tokens, self._events = None, []
            return
        for kind, history, extra in self._events:
            prompt = ids[_history_key(history)]
            if kind == "lookup":
                hit = self._cache.lookup(prompt)
                if extra in self._counted and self.hit_tokens is not None:
                    self.hit_tokens += hit
            else:
                self._cache.add_reply(prompt, extra)
        self._events, self._counted = [], set()


def _history_key(history: Sequence) -> str:
    return json.dumps(history, sort_keys=True)


async def run_phase(target: Target, workload: Sequence[Conversation], phase: Phase,
                    unbounded: UnboundedPrefixCache | None = None) -> tuple[list[RequestRecord], float]:
    """Drives the workload through the target on the phase's schedule; returns the records and the wall time.
    `unbounded` is told every prompt sent and every reply received, and counts the lookups of requests that ran."""
    clock = time.perf_counter
    records: list[RequestRecord] = []

    async def converse(conversation: Conversation) -> None:
        history = target.open_history(conversation.prefix_ids)
        prompt_tokens = len(conversation.prefix_ids)
        for turn in conversation.turns:
            target.add_message(history, turn.message_ids)
            prompt_tokens += len(turn.message_ids)
            # The client's own bookkeeping (the unbounded cache's hashing) stays outside the request's timed span.
            probe = unbounded.lookup(history) if unbounded is not None else None
            # A target that renders the prompt itself reports its length, which then replaces this count.
            record = RequestRecord(prompt_tokens, turn.output_tokens, clock())
            records.append(record)
            reply: list[int] = []
            reply_text: list[str] = []
            try:
                async for chunk in target.stream(tuple(history), turn.output_tokens):
                    first = not record.chunk_times_s and chunk.tokens
                    record.add_chunk(clock(), chunk.tokens)
                    if unbounded is not None and first:
                        unbounded.add(history)  # the prompt is computed once its first token is out
                    if chunk.token_ids is not None:
                        reply.extend(chunk.token_ids)
                    reply_text.append(chunk.text)
                    if chunk.prompt_tokens is not None:
                        record.prompt_tokens = chunk.prompt_tokens
                    if chunk.cached_tokens is not None:
                        record.cached_tokens = chunk.cached_tokens
                    if chunk.server_ttft_s is not None:
                        record.server_ttft_s = chunk.server_ttft_s
            except TargetError as exc:
                record.error = str(exc)
            record.done_s = clock()
            if unbounded is not None and record.error is None:
                unbounded.count(probe)
                if reply:
                    unbounded.add_reply(history, reply[:-1])
            if record.error is None and len(conversation.turns) > 1:
                record.error = target.reply_missing(reply, "".join(reply_text), record.output_tokens)
            if record.error is not None:
                return  # the rest of the conversation has no history to build on
            target.add_reply(history, reply, "".join(reply_text))
            prompt_tokens += record.output_tokens

    started_s = clock()
    if phase.closed_loop:
        pending = iter(workload)

        async def worker() -> None:
            for conversation in pending:
                await converse(conversation)

        await asyncio.gather(*(worker() for _ in range(min(phase.concurrency, len(workload)))))
    else:
        gate = asyncio.Semaphore(phase.concurrency) if phase.concurrency else None

        async def arrive(conversation: Conversation, arrival_s: float) -> None:
            await asyncio.sleep(max(0.0, started_s + arrival_s - clock()))
            if gate is None:
                await converse(conversation)
            else:
                async with gate:
                    await converse(conversation)

        await asyncio.gather(*(arrive(conversation, arrival_s)
                               for conversation, arrival_s in zip(workload, phase.arrivals_s)))
    return records, clock() - started_s


async def run_warmup(target: Target, count: int, vocab_size: int | None) -> None:
    for _ in range(count):
        history = target.open_history(())
        target.add_message(history, warmup_prompt(vocab_size))
        try:
            async for _chunk in target.stream(tuple(history), WARMUP_OUTPUT_TOKENS):
                pass
        except TargetError as exc:
            raise BenchError(f"the warm-up request failed: {exc}") from None


class InProcessEngine:
    """The engine of --serve-args driven straight from this process (add_request + step), closed loop only."""

    def __init__(self, serve_args: Sequence[str]):
        from hybridkv.cli import build_parser
        from hybridkv.sidecar.core.engine import Engine
        from hybridkv.sidecar.serving.cli import build_configs

        engine_config = build_configs(build_parser().parse_args(["serve", *serve_args]))[0]
        self._engine = Engine(engine_config)
        self._serial = 0

    def close(self) -> None:
        self._engine.close()

    def run(self, workload: Sequence[Conversation], concurrency: int) -> tuple[list[RequestRecord], float, float]:
        """Records, wall seconds and this process's CPU seconds of one closed-loop round."""
        from hybridkv.sidecar.core.sampling import SamplingParams

        clock = time.perf_counter
        records: list[RequestRecord] = []
        live: dict[str, tuple[Conversation, int, list[int], RequestRecord, list[int]]] = {}
        pending = iter(workload)

        def submit(conversation: Conversation, turn_index: int, history: list[int]) -> None:
            turn = conversation.turns[turn_index]
            history = history + list(turn.message_ids)
            record = RequestRecord(len(history), turn.output_tokens, clock())
            records.append(record)
            self._serial += 1
            request_id = f"bench-{self._serial}"
            try:
                self._engine.add_request(request_id, history, SamplingParams(
                    max_tokens=turn.output_tokens, temperature=0.0, ignore_eos=True))
            except UserError as exc:
                record.error, record.done_s = str(exc), clock()
                start_next()
                return
            live[request_id] = (conversation, turn_index, history, record, [])

        def start_next() -> None:
            conversation = next(pending, None)
            if conversation is not None:
                submit(conversation, 0, list(conversation.prefix_ids))

        started_s, started_cpu_s = clock(), time.process_time()
        for _ in range(min(concurrency, len(workload))):
            start_next()
        while live:
            for output in self._engine.step():
                conversation, turn_index, history, record, reply = live[output.request_id]
                record.add_chunk(clock(), len(output.new_token_ids))
                reply.extend(output.new_token_ids)
                if output.finished:
                    record.done_s = clock()
                    del live[output.request_id]
                    if turn_index + 1 < len(conversation.turns):
                        submit(conversation, turn_index + 1, history + reply)
                    else:
                        start_next()
        return records, clock() - started_s, time.process_time() - started_cpu_s

    def warmup(self, count: int) -> None:
        prompt = warmup_prompt(self._engine.geometry.vocab_size)
        workload = [Conversation((), (Turn(prompt, WARMUP_OUTPUT_TOKENS),))] * count
        self.run(workload, 1)


# ------------------------------------------------------------------------------------------- the server as a process


def _cpu_seconds(stat_path: str) -> float:
    """utime + stime of a /proc stat file, in seconds; 0 for a process that has already exited."""
    try:
        with open(stat_path) as handle:
            fields = handle.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants, from /proc/PID/task/TID/children (Linux)."""
    pids, index = [pid], 0
    while index < len(pids):
        task_dir = f"/proc/{pids[index]}/task"
        index += 1
        for task in os.listdir(task_dir) if os.path.isdir(task_dir) else ():
            try:
                with open(f"{task_dir}/{task}/children") as handle:
                    pids.extend(int(child) for child in handle.read().split())
            except FileNotFoundError:
                continue
    return pids


def server_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of (the server process `pid` with its descendants, the engine process; its main thread, the
    asyncio event loop that runs the gRPC and HTTP handlers)."""
    total_s = sum(_cpu_seconds(f"/proc/{member}/stat") for member in _process_tree(pid))
    return total_s, _cpu_seconds(f"/proc/{pid}/task/{pid}/stat")


SERVER_WARNINGS_KEPT = 20
SERVER_WARNING_CHARS = 600
# `hybridkv.sidecar.LOG_FORMAT`'s lines at WARNING or above: "2026-12-07 14:45:21,931 WARNING logger: message".
_WARNING_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (WARNING|ERROR|CRITICAL) ")


def logged_warnings(lines: Iterable[str]) -> list[str]:
    """The lines of a `hybridkv serve` log (`TIME LEVEL LOGGER: message`) at WARNING or above: the first
    SERVER_WARNINGS_KEPT, each cut to SERVER_WARNING_CHARS, and a last line counting the rest when there are more."""
    kept, more = [], 0
    for line in lines:
        if not _WARNING_LINE.match(line):
            continue
        if len(kept) < SERVER_WARNINGS_KEPT:
            line = line.rstrip("\n")
            kept.append(line if len(line) <= SERVER_WARNING_CHARS else line[:SERVER_WARNING_CHARS] + " ...")
        else:
            more += 1
    if more:
        kept.append(f"... and {more} more")
    return kept


class SidecarProcess:
    """`hybridkv serve` with the given flags in a subprocess on a free loopback port, ready on entry."""

    def __init__(self, serve_args: Sequence[str], ready_timeout_s: float, http: bool = False,
                 log_path: Path | None = None):
        from hybridkv.net import free_loopback_port

        for flag in ("--host", "--port"):
            if any(arg == flag or arg.startswith(flag + "=") for arg in serve_args):
                raise BenchError(f"--serve-args: leave out {flag}; the benchmark serves on a free loopback port")
        self.port = free_loopback_port()
        self.address = f"127.0.0.1:{self.port}"
        # Its Prometheus endpoint on another free port, so the prefix cache's counters can be read per phase.
        given = next((arg for arg in serve_args if arg.startswith("--metrics-port")), None)
        metrics_port = free_loopback_port() if given is None else None
        defaults = [] if given is not None else ["--metrics-port", str(metrics_port)]
        # gRPC is always there; the HTTP API is on a free port when the benchmark talks to it, else off (it would
        # otherwise take port 8000). An --http-port in the flags stands.
        given_http = next((arg for arg in serve_args if arg.startswith("--http-port")), None)
        if http and given_http is not None:
            raise BenchError("--serve-args: leave out --http-port with --api chat; the benchmark picks a free port")
        self.http_port = free_loopback_port() if http else None
        if given_http is None:
            defaults += ["--http-port", str(self.http_port or 0)]
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None
        self._command = [sys.executable, "-P", "-m", "hybridkv", "serve", *serve_args, *defaults,
                         "--host", "127.0.0.1", "--port", str(self.port)]
        self._ready_timeout_s = ready_timeout_s
        self._log_path = log_path
        self.warnings: list[str] = []  # what the server logged at WARNING or above, read when it stops

    def __enter__(self) -> SidecarProcess:
        import grpc

        from hybridkv.api.client import READINESS_SERVICE, GenerationClient

        if self._log_path is not None:
            try:
                self._log = open(self._log_path, "w+")  # noqa: SIM115 - closed in __exit__
            except OSError as exc:
                raise BenchError(f"--server-log {self._log_path}: {exc.strerror}") from None
        else:
            self._log = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(self._command, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline_s = time.monotonic() + self._ready_timeout_s
        with GenerationClient(self.address) as client:
            while True:
                if self._process.poll() is not None:
                    self._log.seek(0)
                    output = self._log.read()[-3000:]
                    self._log.close()
                    raise BenchError(f"hybridkv serve exited with {self._process.returncode}:\n{output}")
                try:
                    if client.check_health(READINESS_SERVICE, timeout_s=1.0) == "SERVING":
                        return self
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline_s:
                    self.__exit__()
                    raise BenchError(f"hybridkv serve did not turn ready within {self._ready_timeout_s:g} s "
                                     "(--ready-timeout-s)")
                time.sleep(0.2)

    def cpu_seconds(self) -> tuple[float, float]:
        return server_cpu_seconds(self._process.pid)

    def __exit__(self, *exc_info) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.seek(0)
        self.warnings = logged_warnings(self._log)
        self._log.close()


# ------------------------------------------------------------------------------------------------------------ metrics

PREFIX_CACHE_KINDS = ("prompt_end", "inside_prompt", "output_end")
# The server's request latency histograms (vLLM's names): end to end, then the engine's split of a request's time,
# and the server's time to first token (from the request reaching the front door to its first token leaving it).
REQUEST_TIMES = ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "time_to_first_token")


def read_server_counters(metrics_url: str) -> dict[str, float]:
    """The server's counters from its Prometheus text: prefix-cache tokens queried and hit, hit tokens per checkpoint
    kind, engine steps per kind, the engine's step seconds and device-wait seconds (all 0 on a server without
    them)."""
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            text = response.read(16 * 1024 * 1024).decode()
    except OSError as exc:
        raise BenchError(f"cannot read the metrics at {metrics_url}: {exc}") from None
    from prometheus_client.parser import text_string_to_metric_families

    counters = dict.fromkeys(("queries", "hits", *PREFIX_CACHE_KINDS, *(f"steps_{kind}" for kind in STEP_KINDS),
                              "step_seconds", "device_wait_seconds", "prefill_held_steps", "tpot_held_steps",
                              "jit_compiles", "shared_prefix_waits",
                              *(f"{name}_{part}" for name in REQUEST_TIMES for part in ("sum", "count"))), 0.0)
    seconds = {"hybridkv:engine_step_seconds_total": "step_seconds",
               "hybridkv:engine_device_wait_seconds_total": "device_wait_seconds",
               "hybridkv:prefill_held_steps_total": "prefill_held_steps",
               "hybridkv:tpot_held_steps_total": "tpot_held_steps",
               "hybridkv:jit_compiles_after_ready_total": "jit_compiles",
               "hybridkv:prefix_cache_shared_prefix_waits_total": "shared_prefix_waits",
               **{f"vllm:{name}_seconds_{part}": f"{name}_{part}" for name in REQUEST_TIMES
                  for part in ("sum", "count")}}
    # vLLM's series carry a model_name label; the sum over labels is this server's count.
    names = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                counters[names[sample.name]] += sample.value
            elif sample.name == "hybridkv:prefix_cache_hits_by_kind_total" and sample.labels.get("kind") in counters:
                counters[sample.labels["kind"]] += sample.value
            elif sample.name == "hybridkv:engine_steps_total" and f"steps_{sample.labels.get('kind')}" in counters:
                counters[f"steps_{sample.labels['kind']}"] += sample.value
            elif sample.name in seconds:
                counters[seconds[sample.name]] += sample.value
    return counters


def engine_steps_summary(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """The engine's steps in one phase: how many of each kind, their mean time, the share of it spent waiting for
    the device (near 1: the device set the pace; near 0: the host did), how many steps held waiting prompts back,
    and how many kernels the server compiled during the phase (each one a stall). None from a server without them."""
    steps = {kind: int(after[f"steps_{kind}"] - before[f"steps_{kind}"]) for kind in STEP_KINDS}
    step_s = after["step_seconds"] - before["step_seconds"]
    if not sum(steps.values()) or step_s <= 0:
        return None
    return {"steps": steps, "mean_step_ms": 1000 * step_s / sum(steps.values()),
            "device_wait_fraction": (after["device_wait_seconds"] - before["device_wait_seconds"]) / step_s,
            "prefill_held_steps": int(after.get("prefill_held_steps", 0) - before.get("prefill_held_steps", 0)),
            "tpot_held_steps": int(after.get("tpot_held_steps", 0) - before.get("tpot_held_steps", 0)),
            "jit_compiles": int(after.get("jit_compiles", 0) - before.get("jit_compiles", 0))}


def request_times_summary(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """The mean of the server's request latency histograms over one phase (ms): end to end, and the engine's split
    of it into waiting to be scheduled, the prompt's steps up to the first token and the remaining tokens; the
    server's time to first token (None from a server without that histogram). The rest of the server's time is its
    own (tokenizing, the engine process's pipe and inbox, streaming). None from a server without them."""
    counts = {name: after[f"{name}_count"] - before[f"{name}_count"] for name in REQUEST_TIMES}
    if not counts["e2e_request_latency"]:
        return None
    means = {name: 1000 * (after[f"{name}_sum"] - before[f"{name}_sum"]) / counts[name] if counts[name] else None
             for name in REQUEST_TIMES}
    return {"requests": int(counts["e2e_request_latency"]), "e2e_ms": means["e2e_request_latency"],
            "queue_ms": means["request_queue_time"], "prefill_ms": means["request_prefill_time"],
            "decode_ms": means["request_decode_time"], "server_ttft_ms": means["time_to_first_token"]}


def prefix_cache_summary(before: dict[str, float], after: dict[str, float], unbounded_hit_tokens: int | None) -> dict:
    """What one phase looked up and found in the prefix cache, and what an unbounded cache could have found (None
    where the client does not know the prompts' token ids)."""
    delta = {key: after[key] - before[key] for key in before}
    return {"queried_tokens": int(delta["queries"]), "hit_tokens": int(delta["hits"]),
            "hit_fraction": delta["hits"] / delta["queries"] if delta["queries"] else 0.0,
            "hit_tokens_by_kind": {kind: int(delta[kind]) for kind in PREFIX_CACHE_KINDS},
            "unbounded_hit_tokens": unbounded_hit_tokens,
            "fraction_of_unbounded": delta["hits"] / unbounded_hit_tokens if unbounded_hit_tokens else None,
            "shared_prefix_waits": int(delta.get("shared_prefix_waits", 0))}


def reported_cache_summary(records: Sequence[RequestRecord]) -> dict | None:
    """The prompt tokens the responses said came from the prefix cache, and TTFT of the requests with a hit against
    those without (None where no response said: a server without the field)."""
    done = [record for record in records if record.error is None and record.cached_tokens is not None]
    if not done:
        return None
    hits = [record for record in done if record.cached_tokens > 0]
    misses = [record for record in done if record.cached_tokens == 0]
    prompt_tokens = sum(record.prompt_tokens for record in done)
    cached_tokens = sum(record.cached_tokens for record in done)
    return {"requests": len(done), "requests_with_a_hit": len(hits), "cached_tokens": cached_tokens,
            "fraction_of_prompt_tokens": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            "ttft_ms_with_a_hit": distribution([record.ttft_s for record in hits if record.chunk_times_s]),
            "ttft_ms_without": distribution([record.ttft_s for record in misses if record.chunk_times_s])}


def front_door_gap(records: Sequence[RequestRecord]) -> dict | None:
    """Request by request, the client's time to first token less the server's (the network, the gRPC stacks and the
    client's own loop), in ms; None where the server does not report its own."""
    return distribution([record.ttft_s - record.server_ttft_s for record in records
                         if record.error is None and record.server_ttft_s is not None and record.chunk_times_s])


def request_rows(records: Sequence[RequestRecord]) -> list[dict]:
    """Each request of a phase as the client saw it, in the order sent: seconds from the phase's first send, its
    tokens (prompt, output, from the prefix cache as reported), TTFT and end to end at the client, the server's own
    TTFT where reported (ms), and its error, for reading a phase request by request after the run."""
    if not records:
        return []
    first_s = min(record.sent_s for record in records)
    rows = []
    for record in sorted(records, key=lambda record: record.sent_s):
        done = record.error is None and record.chunk_times_s
        rows.append({"sent_s": record.sent_s - first_s, "prompt_tokens": record.prompt_tokens,
                     "output_tokens": record.output_tokens, "cached_tokens": record.cached_tokens,
                     "ttft_ms": 1000 * record.ttft_s if done else None,
                     "server_ttft_ms": 1000 * record.server_ttft_s if done and record.server_ttft_s is not None
                     else None,
                     "e2e_ms": 1000 * (record.done_s - record.sent_s) if done else None,
                     "error": None if record.error is None else record.error[:200]})
    return rows


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (fraction in [0, 1]) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1))
    return ordered[rank]


def distribution(values: Sequence[float], scale: float = 1000.0) -> dict | None:
    """p50/p90/p99 and mean of `values` times `scale` (seconds to ms by default); None when there are none."""
    if not values:
        return None
    figures = {f"p{round(q * 100)}": scale * percentile(values, q) for q in QUANTILES}
    figures["mean"] = scale * statistics.fmean(values)
    return figures


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, record: RequestRecord) -> bool:
        if record.error is not None or not record.output_tokens:
            return False
        if self.ttft_ms is not None and 1000 * record.ttft_s > self.ttft_ms:
            return False
        return self.tpot_ms is None or record.output_tokens < 2 or 1000 * record.tpot_s <= self.tpot_ms


def first_shape_stall(records: Sequence[RequestRecord]) -> dict | None:
    """Each request's TTFT against the median TTFT of its prompt-length bucket [2^k, 2^(k+1)): the worst ratio."""
    buckets: dict[int, list[RequestRecord]] = defaultdict(list)
    for record in records:
        if record.error is None and record.output_tokens:
            buckets[record.prompt_tokens.bit_length() - 1].append(record)
    if not buckets:
        return None
    worst, worst_median_s, over = None, 0.0, 0
    for members in buckets.values():
        median_s = statistics.median(record.ttft_s for record in members)
        for record in members:
            ratio = record.ttft_s / median_s if median_s > 0 else 1.0
            over += ratio > STALL_RATIO
            if worst is None or ratio > worst[0]:
                worst, worst_median_s = (ratio, record), median_s
    ratio, record = worst
    low = 1 << (record.prompt_tokens.bit_length() - 1)
    return {"worst_ratio": ratio, "prompt_tokens": record.prompt_tokens, "ttft_ms": 1000 * record.ttft_s,
            "bucket_tokens": [low, 2 * low - 1], "bucket_median_ttft_ms": 1000 * worst_median_s,
            "requests_over_limit": over, "limit_ratio": STALL_RATIO, "passed": ratio <= STALL_RATIO}


def summarize(records: Sequence[RequestRecord], wall_s: float, slo: Slo) -> dict:
    """The phase's figures from what the client saw."""
    done = [record for record in records if record.error is None]
    answered = [record for record in done if record.output_tokens]
    prompt_tokens = sum(record.prompt_tokens for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    errors = sorted({record.error for record in records if record.error is not None})
    summary = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors[:ERRORS_KEPT],
        "outputs_not_as_asked": sum(record.output_tokens != record.asked_output_tokens for record in done),
        "wall_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(done) / wall_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall_s,
        "output_tokens_per_s": output_tokens / wall_s,
        "mean_in_flight": sum(record.done_s - record.sent_s for record in done) / wall_s,
        "ttft_ms": distribution([record.ttft_s for record in answered]),
        "tpot_ms": distribution([record.tpot_s for record in answered if record.output_tokens > 1]),
        "itl_ms": distribution([gap for record in answered for gap in record.itl_s()]),
        "e2e_ms": distribution([record.done_s - record.sent_s for record in done]),
        "prompt_tokens_distribution": distribution([record.prompt_tokens for record in done], scale=1.0),
        "goodput": None,
        "first_shape_stall": first_shape_stall(records),
    }
    if slo.given:
        good = sum(slo.met(record) for record in records)
        summary["goodput"] = {"slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms, "requests_met": good,
                              "fraction_met": good / len(records), "requests_per_s": good / wall_s}
    return summary


# ---------------------------------------------------------------------------------------------------- sum of parts


@dataclass(frozen=True)
class Parts:
    """The engine's measured parts: a prefill rate and the decode step time by batch (interpolated between)."""
    prefill_tokens_per_s: float
    decode_step_ms_by_batch: tuple[tuple[float, float], ...]  # sorted by batch
    source: str

    def decode_step_ms(self, batch: float) -> float:
        points = self.decode_step_ms_by_batch
        if batch <= points[0][0]:
            return points[0][1]
        for (low_batch, low_ms), (high_batch, high_ms) in zip(points, points[1:]):
            if batch <= high_batch:
                return low_ms + (high_ms - low_ms) * (batch - low_batch) / (high_batch - low_batch)
        return points[-1][1]


def _positive(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BenchError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def load_parts(path: Path | None, prefill_tokens_per_s: float | None, decode_step_ms: float | None) -> Parts | None:
    """Parts from a bench/throughput.py result and/or the flags (which override the file); None when neither."""
    if path is None:
        if prefill_tokens_per_s is None and decode_step_ms is None:
            return None
        if prefill_tokens_per_s is None or decode_step_ms is None:
            raise BenchError("--prefill-tok-s and --decode-step-ms go together (or give --parts FILE)")
        return Parts(_positive(prefill_tokens_per_s, "--prefill-tok-s"),
                     ((1.0, _positive(decode_step_ms, "--decode-step-ms")),), "flags")
    try:
        result = json.loads(path.read_text())
        rows = result["engine"]["rows"]
        prefill = max(_positive(row["prefill_tokens_per_s"], f"{path}: prefill_tokens_per_s") for row in rows)
        steps = tuple(sorted((_positive(row["batch"], f"{path}: batch"),
                              _positive(row["decode_ms_per_step"], f"{path}: decode_ms_per_step")) for row in rows))
    except OSError as exc:
        raise BenchError(f"--parts: cannot read {str(path)!r}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"--parts: {str(path)!r} is not a bench/throughput.py result with engine rows "
                         f"({type(exc).__name__}: {exc})") from None
    source = str(path)
    if prefill_tokens_per_s is not None:
        prefill, source = _positive(prefill_tokens_per_s, "--prefill-tok-s"), f"{source} and flags"
    if decode_step_ms is not None:
        steps, source = ((1.0, _positive(decode_step_ms, "--decode-step-ms")),), f"{source} and flags"
    return Parts(prefill, steps, source)


def sum_of_parts_bound(records: Sequence[RequestRecord], parts: Parts, decode_batch: float) -> dict:
    """What the phase's completed requests need of the engine's parts alone, as wall time and as each figure."""
    done = [record for record in records if record.error is None and record.output_tokens]
    step_s = parts.decode_step_ms(decode_batch) / 1000
    prompt_tokens = sum(record.prompt_tokens for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    decode_steps = sum(record.output_tokens - 1 for record in done) / decode_batch
    prefill_s = prompt_tokens / parts.prefill_tokens_per_s
    bound_s = prefill_s + decode_steps * step_s
    ideal_ttft_s = [record.prompt_tokens / parts.prefill_tokens_per_s for record in done]
    step_only = distribution([step_s])
    return {
        "prefill_tokens_per_s": parts.prefill_tokens_per_s,
        "decode_batch": decode_batch,
        "decode_step_ms": 1000 * step_s,
        "prefill_s": prefill_s,
        "decode_steps": decode_steps,
        "decode_s": decode_steps * step_s,
        "bound_s": bound_s,
        "requests_per_s": len(done) / bound_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / bound_s,
        "output_tokens_per_s": output_tokens / bound_s,
        "ttft_ms": distribution(ideal_ttft_s),
        "tpot_ms": step_only,
        "itl_ms": step_only,
        "e2e_ms": distribution([ttft_s + (record.output_tokens - 1) * step_s
                                for ttft_s, record in zip(ideal_ttft_s, done)]),
    }


THROUGHPUTS = ("requests_per_s", "total_tokens_per_s", "output_tokens_per_s")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def ratios_to_bound(summary: dict, bound: dict) -> dict:
    """Measured / bound for every figure: below 1 for throughputs, above 1 for latencies, 1 is the parts' limit."""
    ratios = {key: summary[key] / bound[key] for key in THROUGHPUTS}
    for key in LATENCIES:
        if summary[key] is not None and bound[key] is not None:
            ratios[key] = {quantile: summary[key][quantile] / bound[key][quantile] for quantile in summary[key]}
    return ratios


def decode_batch_of(phase: Phase, summary: dict, conversations: int, max_num_seqs: int | None) -> float:
    held = min(phase.concurrency, conversations) if phase.closed_loop else summary["mean_in_flight"]
    return max(1.0, min(held, max_num_seqs or math.inf))


# ------------------------------------------------------------------------------------------------------------- report


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _triple(figures_ms: dict | None, in_seconds: bool = False) -> str:
    if figures_ms is None:
        return "-"
    values_ms = [figures_ms[f"p{round(q * 100)}"] for q in QUANTILES]
    return " / ".join(f"{value / 1000:.3g}" if in_seconds else _ms(value) for value in values_ms)


def _row(label: str, requests: str, figures: dict, goodput: str) -> str:
    return (f"| {label} | {requests} | {figures['requests_per_s']:.2f} | {figures['total_tokens_per_s']:,.0f} | "
            f"{figures['output_tokens_per_s']:,.0f} | {_triple(figures['ttft_ms'])} | {_triple(figures['tpot_ms'])} | "
            f"{_triple(figures['itl_ms'])} | {_triple(figures['e2e_ms'], in_seconds=True)} | {goodput} |")


def format_table(phases: Sequence[dict]) -> str:
    """The phases' figures as a Markdown table, with the in-process engine's and the bound's rows under each phase."""
    lines = ["| phase | requests | req/s | total tok/s | output tok/s | TTFT p50 / p90 / p99 (ms) | "
             "TPOT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | E2E p50 / p90 / p99 (s) | goodput req/s |",
             "|---|---:|---:|---:|---:|---|---|---|---|---:|"]
    for phase in phases:
        for label, figures in ((phase["name"], phase["summary"]), ("  in process", phase.get("in_process"))):
            if figures is not None:
                goodput = "-" if figures["goodput"] is None else f"{figures['goodput']['requests_per_s']:.2f}"
                lines.append(_row(label, f"{figures['completed']}/{figures['requests']}", figures, goodput))
        if phase["bound"] is not None:
            lines.append(_row(f"  sum of parts: {phase['bound']['bound_s']:.2f} s", "", phase["bound"], ""))
    return "\n".join(lines)


def format_notes(phase: dict) -> list[str]:
    """The lines printed under the table for one phase: bound ratios, stall check, failures, CPU, overhead."""
    figures, notes = phase["summary"], []
    bound, ratios = phase["bound"], phase["ratios_to_bound"]
    if bound is not None:
        latency = ", ".join(f"{key.removesuffix('_ms').upper()} p50 x{ratios[key]['p50']:.1f}"
                            for key in LATENCIES if key in ratios)
        notes.append(f"{phase['name']}: {100 * ratios['total_tokens_per_s']:.0f}% of the sum-of-parts total tok/s "
                     f"(prefill {bound['prefill_s']:.2f} s at {bound['prefill_tokens_per_s']:,.0f} tok/s + "
                     f"{bound['decode_steps']:.0f} decode steps of {bound['decode_step_ms']:.2f} ms at batch "
                     f"{bound['decode_batch']:.0f}); {latency}")
    stall = figures["first_shape_stall"]
    if stall is not None:
        worst = (f"worst TTFT {stall['worst_ratio']:.2f}x the median of its bucket ({stall['prompt_tokens']} prompt "
                 f"tokens: {_ms(stall['ttft_ms'])} ms against {_ms(stall['bucket_median_ttft_ms'])} ms), "
                 f"{stall['requests_over_limit']} requests above {stall['limit_ratio']:g}x")
        if phase.get("closed_loop") and phase.get("concurrency") == 1:
            notes.append(f"{phase['name']}: first-shape stall check {'passed' if stall['passed'] else 'FAILED'}: "
                         f"{worst}")
        else:
            # Requests in flight together wait for each other's steps, so the spread is queueing as much as
            # stalls; the compile count below is this phase's reading of a stall.
            notes.append(f"{phase['name']}: TTFT within length buckets (queueing included; the stall check is read "
                         f"one request at a time): {worst}")
    if figures["failed"]:
        notes.append(f"{phase['name']}: {figures['failed']} requests failed: {'; '.join(figures['errors'])}")
    if figures["outputs_not_as_asked"]:
        notes.append(f"{phase['name']}: {figures['outputs_not_as_asked']} requests got another output length "
                     "than asked")
    prefix = phase.get("prefix_cache")
    if prefix is not None and prefix["queried_tokens"]:
        kinds = ", ".join(f"{kind} {tokens:,}" for kind, tokens in prefix["hit_tokens_by_kind"].items())
        of_unbounded = prefix.get("fraction_of_unbounded")
        unbounded = (f"; an unbounded cache: {prefix['unbounded_hit_tokens']:,}, so {100 * of_unbounded:.1f}% of it"
                     if of_unbounded is not None else "")
        waits = (f"; requests waited {prefix['shared_prefix_waits']:,} steps for a prefix another was computing"
                 if prefix.get("shared_prefix_waits") else "")
        notes.append(f"{phase['name']}: prefix cache hit {prefix['hit_tokens']:,} of {prefix['queried_tokens']:,} "
                     f"prompt tokens ({100 * prefix['hit_fraction']:.1f}%; by checkpoint: {kinds}{unbounded}{waits})")
    reported = phase.get("reported_cache")
    if reported is not None and reported["cached_tokens"]:
        split = "; ".join(f"TTFT p50 {_ms(ttft['p50'])} ms for the {count} requests {which}"
                          for which, count, ttft in (
                              ("with a hit", reported["requests_with_a_hit"], reported["ttft_ms_with_a_hit"]),
                              ("without", reported["requests"] - reported["requests_with_a_hit"],
                               reported["ttft_ms_without"])) if ttft is not None)
        notes.append(f"{phase['name']}: the responses report {reported['cached_tokens']:,} prompt tokens from the "
                     f"prefix cache ({100 * reported['fraction_of_prompt_tokens']:.1f}%); {split}")
    steps = phase.get("engine_steps")
    if steps is not None:
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in steps["steps"].items())
        notes.append(f"{phase['name']}: engine steps {kinds}; mean {steps['mean_step_ms']:.1f} ms, "
                     f"{100 * steps['device_wait_fraction']:.0f}% of it waiting for the device; "
                     f"{steps['prefill_held_steps']:,} steps held waiting prompts back, "
                     f"{steps.get('tpot_held_steps', 0):,} more for the TPOT target; "
                     f"{steps['jit_compiles']} kernels compiled during the phase")
    times = phase.get("request_times")
    if times is not None:
        notes.append(f"{phase['name']}: in the server's histograms, a request's mean {times['e2e_ms']:.0f} ms end to "
                     f"end: {times['queue_ms']:.1f} ms queued in the engine, {times['prefill_ms']:.1f} ms from its "
                     f"first step to its first token, {times['decode_ms']:.0f} ms decoding "
                     f"({times['requests']:,} requests)")
        if times.get("server_ttft_ms") is not None:
            client_ms = phase["summary"]["ttft_ms"]["mean"]
            engine_ms = times["queue_ms"] + times["prefill_ms"]
            notes.append(f"{phase['name']}: TTFT mean {client_ms:.1f} ms at the client, {times['server_ttft_ms']:.1f} "
                         f"at the server's front door, {engine_ms:.1f} in the engine: "
                         f"{client_ms - times['server_ttft_ms']:.1f} ms between client and front door, "
                         f"{times['server_ttft_ms'] - engine_ms:.1f} between front door and engine (the engine "
                         "process's pipe and inbox, the first token's way back)")
    gap = phase.get("front_door_gap_ms")
    if gap is not None:
        notes.append(f"{phase['name']}: request by request, the client's TTFT less the server's own (its last "
                     f"response's times): p50 {gap['p50']:.1f} / p90 {gap['p90']:.1f} / p99 {gap['p99']:.1f} / mean "
                     f"{gap['mean']:.1f} ms")
    if phase.get("client_cpu_fraction") is not None:
        notes.append(f"{phase['name']}: the benchmark's own CPU {100 * phase['client_cpu_fraction']:.0f}% of one core "
                     "(near 100%, its loop sets the latencies it measures)")
    if phase.get("server_cpu_us_per_output_token") is not None:
        notes.append(f"{phase['name']}: server CPU {phase['server_cpu_us_per_output_token']:.0f} us per output token "
                     f"(event loop alone: {phase['event_loop_cpu_us_per_output_token']:.0f} us)")
    overhead = phase.get("in_process_overhead")
    if overhead is not None:
        notes.append(f"{phase['name']}: over the in-process engine, the server adds "
                     f"{100 * overhead['itl_p50_fraction']:+.1f}% to the median inter-token time and "
                     f"{100 * overhead['cpu_per_output_token_fraction']:+.1f}% CPU per output token "
                     f"(in process: ITL p50 {overhead['in_process_itl_p50_ms']:.2f} ms, "
                     f"{overhead['in_process_cpu_us_per_output_token']:.0f} us CPU per token)")
    return notes


# --------------------------------------------------------------------------------------------------------------- main


def _list_of(kind: type, text: str, flag: str, low: float, high: float) -> list:
    try:
        values = [kind(part) for part in text.split(",")]
    except ValueError:
        raise BenchError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or len(values) > 32 or not all(low <= value <= high for value in values):
        raise BenchError(f"{flag}: expected 1 to 32 values in [{low:g}, {high:g}], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="grpc://HOST:PORT (a running sidecar) or http://HOST:PORT (OpenAI-style)")
    where.add_argument("--serve-args", help="start `hybridkv serve` with these flags (one string) for the run")
    parser.add_argument("--metrics-url", help="the target's Prometheus endpoint (http://HOST:PORT/metrics), read for "
                        "prefix-cache hits per phase (default with --serve-args: the started server's)")
    parser.add_argument("--server-pid", type=int, help="--target: the server's process id on this machine, whose "
                        "CPU (with the engine process) and event loop CPU per output token each phase reports")
    parser.add_argument("--served-model", help="the model name sent to an HTTP target (default: its /v1/models)")
    parser.add_argument("--api", choices=API_NAMES, default="completions",
                        help="HTTP targets: completions (token-id prompts) or chat (messages, rendered by the server's "
                             "chat template; with --serve-args, the started server's HTTP API)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of the random ids (default: the target's)")
    parser.add_argument("--workload", choices=("random", "chat", "document", "trace"), default="random")
    parser.add_argument("--requests", type=int, default=512, help="requests per phase (default %(default)s)")
    parser.add_argument("--seed", type=int, default=3, help="seed of every draw (default %(default)s)")
    parser.add_argument("--prompt-mu", type=float, default=6.0)
    parser.add_argument("--prompt-sigma", type=float, default=0.9)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=4000)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4, help="chat: turns per conversation (default %(default)s)")
    parser.add_argument("--system-tokens", type=int, default=512, help="chat: shared system prompt length")
    parser.add_argument("--documents", type=int, default=4, help="document: how many shared documents")
    parser.add_argument("--document-tokens", type=int, default=2048, help="document: tokens per document")
    parser.add_argument("--trace", type=Path, help="trace: the JSONL file")
    parser.add_argument("--concurrency", help="closed-loop phases: in flight, comma-separated (default 64)")
    parser.add_argument("--request-rate", help="open-loop phases: Poisson requests/s, comma-separated, or 'trace'")
    parser.add_argument("--max-concurrency", type=int, help="open loop: at most this many in flight")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each phase (default 1)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each phase, pooled (default 1)")
    parser.add_argument("--compare-in-process", action="store_true",
                        help="also run each closed-loop round on the engine in this process (needs --serve-args)")
    parser.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    parser.add_argument("--prefill-tok-s", type=float, help="sum of parts: measured prefill tokens/s")
    parser.add_argument("--decode-step-ms", type=float, help="sum of parts: measured decode step time")
    parser.add_argument("--parts", type=Path, help="sum of parts from a bench/throughput.py JSON result")
    parser.add_argument("--request-timeout-s", type=float, default=1800.0, help="per request (default %(default)s)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0, help="--serve-args: wait for ready")
    parser.add_argument("--server-log", type=Path,
                        help="--serve-args: keep the server's output in this file (by default a temporary file; the "
                             "warnings it logged are printed after the run either way)")
    parser.add_argument("--out", type=Path,
                        default=Path(f"bench/results/serving-{datetime.date.today().isoformat()}.json"),
                        help="where to write the results (JSON)")
    return parser


def check_settings(args: argparse.Namespace) -> None:
    bounded = {"requests": (1, MAX_REQUESTS), "turns": (1, 1024), "system_tokens": (0, MAX_PROMPT_TOKENS),
               "documents": (1, 1024), "document_tokens": (1, MAX_PROMPT_TOKENS), "warmup": (0, 64),
               "rounds": (1, 100)}
    for name, (low, high) in bounded.items():
        if not low <= getattr(args, name) <= high:
            raise BenchError(f"--{name.replace('_', '-')} must be in [{low}, {high}], got {getattr(args, name)}")
    for name in ("vocab_size", "max_concurrency"):
        if getattr(args, name) is not None and not 1 <= getattr(args, name) <= 1 << 24:
            raise BenchError(f"--{name.replace('_', '-')} must be in [1, {1 << 24}]")
    for name in ("slo_ttft_ms", "slo_tpot_ms", "request_timeout_s", "ready_timeout_s"):
        if getattr(args, name) is not None:
            _positive(getattr(args, name), f"--{name.replace('_', '-')}")
    if args.workload == "trace" and args.trace is None:
        raise BenchError("--workload trace needs --trace FILE")
    if args.trace is not None and args.workload != "trace":
        raise BenchError("--trace goes with --workload trace")
    if args.server_pid is not None:
        if args.target is None:
            raise BenchError("--server-pid goes with --target (a server this benchmark starts is measured anyway)")
        if args.server_pid < 1 or not os.path.isfile(f"/proc/{args.server_pid}/stat"):
            raise BenchError(f"--server-pid {args.server_pid}: no such process on this machine (Linux /proc)")
    if args.server_log is not None and args.serve_args is None:
        raise BenchError("--server-log goes with --serve-args (the benchmark keeps the log of a server it starts)")
    if args.compare_in_process and args.serve_args is None:
        raise BenchError("--compare-in-process needs --serve-args (the same engine flags for both)")
    if args.compare_in_process and args.request_rate is not None:
        raise BenchError("--compare-in-process runs closed-loop phases only: use --concurrency")
    if args.concurrency is not None and args.request_rate is not None:
        raise BenchError("give --concurrency (closed loop) or --request-rate (open loop), not both; "
                         "--max-concurrency caps an open loop")
    if args.concurrency is not None:
        _list_of(int, args.concurrency, "--concurrency", 1, 1 << 16)
    if args.request_rate not in (None, "trace"):
        _list_of(float, args.request_rate, "--request-rate", 1e-6, 1e6)
    if args.request_rate == "trace" and args.workload != "trace":
        raise BenchError("--request-rate trace goes with --workload trace")


def build_workload(args: argparse.Namespace, lengths: Lengths, vocab_size: int | None) -> list[Conversation]:
    if args.workload == "trace":
        return read_trace(args.trace, args.requests, vocab_size, args.seed)
    if vocab_size is None:
        raise BenchError("the target does not say its vocabulary size: give --vocab-size")
    if args.workload == "chat":
        return chat_workload(args.requests, args.turns, args.system_tokens, lengths, vocab_size, args.seed)
    if args.workload == "document":
        return document_workload(args.requests, args.documents, args.document_tokens, lengths, vocab_size,
                                 args.seed)
    return random_workload(args.requests, lengths, vocab_size, args.seed)


def build_phases(args: argparse.Namespace, workload: Sequence[Conversation]) -> list[Phase]:
    if args.request_rate is None:
        return [Phase(f"concurrency {value}", value)
                for value in _list_of(int, args.concurrency or "64", "--concurrency", 1, 1 << 16)]
    cap = args.max_concurrency
    if args.request_rate == "trace":
        if any(conversation.arrival_s is None for conversation in workload):
            raise BenchError("--request-rate trace needs 'arrival_s' on every line of --trace")
        return [Phase("trace timing", cap, tuple(conversation.arrival_s for conversation in workload))]
    return [Phase(f"rate {rate:g}/s", cap, poisson_arrivals(len(workload), rate, args.seed))
            for rate in _list_of(float, args.request_rate, "--request-rate", 1e-6, 1e6)]


async def measure(args, target: Target, server: SidecarProcess | None, in_process: InProcessEngine | None,
                  workload: list[Conversation], phases: list[Phase], info: dict, vocab_size: int | None,
                  slo: Slo, parts: Parts | None) -> list[dict]:
    results = []
    metrics_url = args.metrics_url or (server.metrics_url if server is not None else None)
    # One for the whole run, as the server's cache outlives phases; block size 16 where the target does not say.
    block_size = info.get("block_size") or 16
    unbounded = UnboundedPrefixCache(block_size) if target.sees_prompt_ids else RenderedPrefixCache(block_size)
    # The server's CPU: the one this benchmark started, or the running one --server-pid names.
    server_cpu = server.cpu_seconds if server is not None else (
        (lambda: server_cpu_seconds(args.server_pid)) if args.server_pid is not None else None)
    for phase in phases:
        records, wall_s, server_cpu_s, loop_cpu_s, client_cpu_s = [], 0.0, 0.0, 0.0, 0.0
        prefix_before = prefix_after = None
        unbounded_hit_tokens = 0
        local_records, local_wall_s, local_cpu_s = [], 0.0, 0.0
        for round_index in range(args.rounds):
            if in_process is not None:
                in_process.warmup(args.warmup)
                round_records, round_wall_s, round_cpu_s = in_process.run(workload, phase.concurrency)
                local_records += round_records
                local_wall_s += round_wall_s
                local_cpu_s += round_cpu_s
            await run_warmup(target, args.warmup, vocab_size)
            if metrics_url is not None:
                counters = read_server_counters(metrics_url)
                # Rounds pool: what each round looked up, warm-up requests left out.
                prefix_before = counters if prefix_before is None else {
                    key: prefix_before[key] + counters[key] - prefix_after[key] for key in counters}
            cpu_before_s = server_cpu() if server_cpu is not None else (0.0, 0.0)
            unbounded_before = unbounded.hit_tokens
            client_before_s = time.process_time()
            round_records, round_wall_s = await run_phase(target, workload, phase, unbounded)
            client_cpu_s += time.process_time() - client_before_s
            await unbounded.settle(target)
            if unbounded_hit_tokens is not None and unbounded.hit_tokens is not None:
                unbounded_hit_tokens += unbounded.hit_tokens - unbounded_before
            else:
                unbounded_hit_tokens = None
            if metrics_url is not None:
                prefix_after = read_server_counters(metrics_url)
            if server_cpu is not None:
                cpu_after_s = server_cpu()
                server_cpu_s += cpu_after_s[0] - cpu_before_s[0]
                loop_cpu_s += cpu_after_s[1] - cpu_before_s[1]
            records += round_records
            wall_s += round_wall_s
            print(f"  {phase.name}: round {round_index + 1}/{args.rounds} done in {round_wall_s:.1f} s", flush=True)
        summary = summarize(records, wall_s, slo)
        bound = None
        if parts is not None and summary["completed"]:
            decode_batch = decode_batch_of(phase, summary, len(workload), info.get("max_num_seqs"))
            bound = sum_of_parts_bound(records, parts, decode_batch)
        measured_cpu = server_cpu is not None and summary["output_tokens"]
        result = {"name": phase.name, "closed_loop": phase.closed_loop, "concurrency": phase.concurrency,
                  "summary": summary, "bound": bound,
                  # This process's CPU over the phase as a share of one core: near 1, the client's own loop sets
                  # the latencies it measures.
                  "client_cpu_fraction": client_cpu_s / wall_s if wall_s > 0 else None,
                  "ratios_to_bound": ratios_to_bound(summary, bound) if bound is not None else None,
                  "server_cpu_us_per_output_token": 1e6 * server_cpu_s / summary["output_tokens"] if measured_cpu
                  else None,
                  "event_loop_cpu_us_per_output_token": 1e6 * loop_cpu_s / summary["output_tokens"] if measured_cpu
                  else None,
                  "prefix_cache": prefix_cache_summary(prefix_before, prefix_after, unbounded_hit_tokens)
                  if metrics_url else None,
                  "reported_cache": reported_cache_summary(records),
                  "front_door_gap_ms": front_door_gap(records),
                  "engine_steps": engine_steps_summary(prefix_before, prefix_after) if metrics_url else None,
                  "request_times": request_times_summary(prefix_before, prefix_after) if metrics_url else None,
                  "request_rows": request_rows(records)}
        if in_process is not None:
            local = summarize(local_records, local_wall_s, slo)
            local_cpu_per_token = 1e6 * local_cpu_s / local["output_tokens"]
            result["in_process"] = local
            result["in_process_overhead"] = {
                "in_process_itl_p50_ms": local["itl_ms"]["p50"],
                "in_process_cpu_us_per_output_token": local_cpu_per_token,
                "itl_p50_fraction": (summary["itl_ms"]["p50"] - local["itl_ms"]["p50"]) / local["itl_ms"]["p50"],
                "cpu_per_output_token_fraction": (result["server_cpu_us_per_output_token"] - local_cpu_per_token)
                / local_cpu_per_token,
            }
        results.append(result)
    return results


async def run_benchmark(args: argparse.Namespace, lengths: Lengths, parts: Parts | None,
                        server: SidecarProcess | None, in_process: InProcessEngine | None) -> dict:
    if server is None:
        url = args.target
    else:
        url = f"http://127.0.0.1:{server.http_port}" if args.api == "chat" else f"grpc://{server.address}"
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    async with make_target(url, args.served_model, args.request_timeout_s, args.api) as target:
        info = await target.describe()
        calibration = await target.calibrate()
        if calibration is not None:
            print(f"{target.name}: the server counts {calibration['tokens_per_word']:.2f} tokens per message word; "
                  "messages are scaled to the workload's token lengths", flush=True)
        vocab_size = args.vocab_size or info.get("vocab_size")
        if vocab_size is None and args.api == "chat":
            vocab_size = CHAT_WORDS  # the ids only spell the messages' words
        workload = build_workload(args, lengths, vocab_size)
        phases = build_phases(args, workload)
        max_model_len = info.get("max_model_len")
        longest = max(workload, key=Conversation.tokens_needed).tokens_needed()
        if max_model_len and longest > max_model_len:
            raise BenchError(f"the workload's longest request needs {longest} tokens (prompt + output) but the "
                             f"target's max_model_len is {max_model_len}: shorten the lengths or raise it")
        requests = sum(len(conversation.turns) for conversation in workload)
        print(f"{requests} requests ({args.workload}, seed {args.seed}) to {url}; phases: "
              f"{', '.join(phase.name for phase in phases)}", flush=True)
        results = await measure(args, target, server, in_process, workload, phases, info, vocab_size, slo, parts)
    return {"target": url, "model_info": info, "calibration": calibration, "requests": requests, "phases": results,
            "parts": None if parts is None else {"source": parts.source,
                                                 "prefill_tokens_per_s": parts.prefill_tokens_per_s,
                                                 "decode_step_ms_by_batch": parts.decode_step_ms_by_batch}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_settings(args)
        lengths = Lengths(args.prompt_mu, args.prompt_sigma, args.prompt_min, args.prompt_max, args.output_min,
                          args.output_max)
        lengths.validate()
        parts = load_parts(args.parts, args.prefill_tok_s, args.decode_step_ms)
        if args.target is not None:
            make_target(args.target, args.served_model, args.request_timeout_s, args.api)  # fails before any work
        serve_args = shlex.split(args.serve_args) if args.serve_args is not None else None
        in_process = InProcessEngine(serve_args) if args.compare_in_process else None
        try:
            if serve_args is not None:
                server = SidecarProcess(serve_args, args.ready_timeout_s, http=args.api == "chat",
                                        log_path=args.server_log)
                with server:
                    report = asyncio.run(run_benchmark(args, lengths, parts, server, in_process))
                report["server_warnings"] = server.warnings
            else:
                report = asyncio.run(run_benchmark(args, lengths, parts, None, in_process))
        finally:
            if in_process is not None:
                in_process.close()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n" + format_table(report["phases"]))
    for phase in report["phases"]:
        for note in format_notes(phase):
            print(note)
    if report.get("server_warnings"):
        print("the server logged:")
        for line in report["server_warnings"]:
            print(f"  {line}")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        **report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
