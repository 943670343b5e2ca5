"""Replay a workload through each allocator's admission rules, so capacity claims are compared on the same requests.

A workload is a list of requests (arrival step, prompt tokens, output tokens); one step is one engine iteration in
which every running request produces one token. Traces are JSONL, one request per line:

    {"arrival_step": 0, "prompt_tokens": 812, "output_tokens": 143}

The replay follows the rules every allocator shares (vLLM v1 and the hybridkv engine alike): requests are admitted
first come, first served while a running slot is free and the pool has the units for the prompt (head-of-line: the
queue waits behind a request that does not fit); a running request takes a new block when its context crosses a block
boundary; when no block is free the most recently admitted request is preempted (its units are freed and it is
recomputed later, keeping its generated tokens as prompt). A request longer than `max_model_len`, or one that could
not fit in the empty pool, is refused on arrival. Allocators differ only through their `PoolModel`: block size,
state units per request, running-slot limit.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridkv.sizing.allocators import PoolModel
from hybridkv.sizing.errors import WorkloadError

MAX_TRACE_REQUESTS = 1_000_000
MAX_TRACE_BYTES = 256 * 1024 * 1024
MAX_REQUEST_TOKENS = 16_777_216
MAX_ARRIVAL_STEP = 2**40


@dataclass(frozen=True)
class TraceRequest:
    arrival_step: int
    prompt_tokens: int
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def _check_field(item: dict, key: str, lower: int, upper: int, where: str) -> int:
    value = item.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        raise WorkloadError(f"{where}: {key} must be an integer in [{lower}, {upper}], got {value!r}")
    return value


def trace_objects(lines, source: str, keys: set[str], unknown_hint: str = ""):
    """(where, object) for each non-blank JSONL line: a JSON object with no key outside `keys`; WorkloadError names
    the line otherwise (`unknown_hint` is appended to the unknown-key message)."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where} is not JSON: {exc.msg}") from None
        except RecursionError:
            raise WorkloadError(f"{where} nests its JSON too deeply") from None
        except ValueError as exc:  # an integer of more digits than Python converts
            raise WorkloadError(f"{where} is not JSON hybridkv can read: {str(exc)[:120]}") from None
        if not isinstance(item, dict):
            raise WorkloadError(f"{where} must be a JSON object")
        unknown = set(item) - keys
        if unknown:
            raise WorkloadError(f"{where} has unknown key(s) {', '.join(sorted(unknown))}{unknown_hint}")
        yield where, item


def decode_step(running: list, waiting: deque, grow, release, result) -> list:
    """One decode step of the replays: each running request, oldest first, grows by one token (`grow(entry)`); when
    it cannot, the newest one not yet grown is preempted (`release`, to the front of `waiting`) until it can, or the
    request itself is. Returns the requests still running; counts preemptions in `result`."""
    survivors, queue = [], list(running)
    while queue:
        entry = queue.pop(0)
        while not grow(entry):
            victim = queue.pop() if queue else entry
            release(victim)
            waiting.appendleft(victim)
            result.preemptions += 1
            if victim is entry:
                break
        else:
            entry.generated += 1
            survivors.append(entry)
    return survivors


def parse_trace(lines, source: str = "<trace>") -> list[TraceRequest]:
    """Parse JSONL trace lines; WorkloadError names the line. Requests are ordered by arrival (stable)."""
    requests = []
    for where, item in trace_objects(lines, source, {"arrival_step", "prompt_tokens", "output_tokens", "id"}):
        requests.append(TraceRequest(
            arrival_step=_check_field(item, "arrival_step", 0, MAX_ARRIVAL_STEP, where),
            prompt_tokens=_check_field(item, "prompt_tokens", 1, MAX_REQUEST_TOKENS, where),
            output_tokens=_check_field(item, "output_tokens", 1, MAX_REQUEST_TOKENS, where),
        ))
        if len(requests) > MAX_TRACE_REQUESTS:
            raise WorkloadError(f"{source} has more than {MAX_TRACE_REQUESTS} requests")
    if not requests:
        raise WorkloadError(f"{source} holds no requests")
    return sorted(requests, key=lambda r: r.arrival_step)


def read_trace(path: str | Path, parse=None) -> list:
    """A JSONL trace file, bounded in size, through `parse` (`parse_trace` unless given): WorkloadError names what
    is wrong."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise WorkloadError(f"{path} is larger than {MAX_TRACE_BYTES} bytes")
        with path.open(encoding="utf-8") as handle:
            return (parse or parse_trace)(handle, str(path))
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path} is not UTF-8 text (byte {exc.start} of a line)") from None


def write_trace(requests: list, path: str | Path) -> None:
    """One JSON object a line: a request's `to_dict()` where it has one, else its fields."""
    with Path(path).open("w") as handle:
        for request in requests:
            record = request.to_dict() if hasattr(request, "to_dict") else asdict(request)
            handle.write(json.dumps(record) + "\n")


def synthetic_workload(
    seed: int,
    num_requests: int,
    max_model_len: int,
    arrivals_per_step: float = 4.0,
    mean_prompt_tokens: int = 1024,
    mean_output_tokens: int = 256,
) -> list[TraceRequest]:
    """Poisson arrivals and log-normal prompt/output lengths (σ = 1), clipped so prompt + output ≤ max_model_len."""
    if not 1 <= num_requests <= MAX_TRACE_REQUESTS:
        raise WorkloadError(f"the number of requests must be in [1, {MAX_TRACE_REQUESTS}], got {num_requests}")
    if not 2 <= max_model_len <= MAX_REQUEST_TOKENS:
        raise WorkloadError(f"max_model_len must be in [2, {MAX_REQUEST_TOKENS}], got {max_model_len}")
    if not arrivals_per_step > 0 or not math.isfinite(arrivals_per_step):
        raise WorkloadError(f"arrivals per step must be a positive number, got {arrivals_per_step}")
    for what, mean in (("prompt", mean_prompt_tokens), ("output", mean_output_tokens)):
        if not 1 <= mean <= max_model_len:
            raise WorkloadError(f"the mean {what} length must be in [1, {max_model_len}], got {mean}")
    rng = random.Random(seed)
    sigma = 1.0

    def lognormal(mean: int, upper: int) -> int:
        # mu chosen so the (unclipped) mean is `mean`
        return max(1, min(upper, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))

    requests, clock = [], 0.0
    for _ in range(num_requests):
        clock += rng.expovariate(arrivals_per_step)
        prompt = lognormal(mean_prompt_tokens, max_model_len - 1)
        output = lognormal(mean_output_tokens, max_model_len - prompt)
        requests.append(TraceRequest(int(clock), prompt, output))
    return requests


@dataclass
class _Running:
    request: TraceRequest
    index: int
    generated: int = 0
    units: int = 0
    blocks: int = 0

    @property
    def context_tokens(self) -> int:
        return self.request.prompt_tokens + self.generated


@dataclass
class ReplayResult:
    allocator: str
    label: str
    steps: int = 0
    completed: int = 0
    refused: int = 0
    preemptions: int = 0
    peak_concurrency: int = 0
    mean_concurrency: float = 0.0
    peak_tokens_held: int = 0
    mean_tokens_held: float = 0.0
    mean_queue_steps: float = 0.0
    generated_tokens: int = 0
    invariant_checks: int = field(default=0, repr=False)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("invariant_checks")
        data["mean_concurrency"] = round(self.mean_concurrency, 2)
        data["mean_tokens_held"] = round(self.mean_tokens_held, 1)
        data["mean_queue_steps"] = round(self.mean_queue_steps, 2)
        return data


def replay(
    pool: PoolModel, requests: list[TraceRequest], max_model_len: int, check_invariants: bool = False
) -> ReplayResult:
    """Run `requests` through `pool`'s admission rules until every request finished or was refused."""
    result = ReplayResult(allocator=pool.allocator.key, label=pool.label)
    pending = deque(sorted(requests, key=lambda r: r.arrival_step))
    waiting: deque[_Running] = deque()
    running: list[_Running] = []
    free_units = pool.pool_units
    first_admitted: dict[int, int] = {}
    concurrency_sum = tokens_sum = 0
    step = 0

    def allocate(entry: _Running, context_tokens: int) -> bool:
        nonlocal free_units
        blocks = pool.blocks_for(context_tokens)
        extra = (blocks - entry.blocks) * pool.units_per_block + (0 if entry.units else pool.state_units_per_request)
        if extra > free_units:
            return False
        free_units -= extra
        entry.units += extra
        entry.blocks = blocks
        return True

    def release(entry: _Running) -> None:
        nonlocal free_units
        free_units += entry.units
        entry.units = entry.blocks = 0

    counter = 0
    while pending or waiting or running:
        while pending and pending[0].arrival_step <= step:
            request = pending.popleft()
            if request.total_tokens > max_model_len or pool.units_for_request(request.total_tokens) > pool.pool_units:
                result.refused += 1
                continue
            waiting.append(_Running(request, counter))
            counter += 1
        # Decode: every running request admitted before this step grows by one token (oldest first).
        running = decode_step(running, waiting, lambda entry: allocate(entry, entry.context_tokens + 1), release,
                              result)
        # Admission: first come, first served; the head of the queue blocks the rest.
        while waiting and len(running) < pool.max_running:
            entry = waiting[0]
            if not allocate(entry, entry.context_tokens + 1):
                break
            waiting.popleft()
            first_admitted.setdefault(entry.index, step - entry.request.arrival_step)
            entry.generated += 1  # the prefill step produces the first output token
            running.append(entry)
        finished = [e for e in running if e.generated >= e.request.output_tokens]
        for entry in finished:
            release(entry)
            result.completed += 1
            result.generated_tokens += entry.request.output_tokens
        running = [e for e in running if e.generated < e.request.output_tokens]
        held = sum(e.context_tokens for e in running)
        concurrency_sum += len(running)
        tokens_sum += held
        result.peak_concurrency = max(result.peak_concurrency, len(running))
        result.peak_tokens_held = max(result.peak_tokens_held, held)
        if check_invariants:
            _check_pool_invariants(pool, running, waiting, free_units)
            result.invariant_checks += 1
        step += 1
        if not running and not waiting and pending:
            step = max(step, pending[0].arrival_step)  # skip idle time
    result.steps = step
    result.mean_concurrency = concurrency_sum / step if step else 0.0
    result.mean_tokens_held = tokens_sum / step if step else 0.0
    result.mean_queue_steps = sum(first_admitted.values()) / len(first_admitted) if first_admitted else 0.0
    return result


def _check_pool_invariants(pool: PoolModel, running: list[_Running], waiting, free_units: int) -> None:
    """Usage equals the sum over live requests; nothing is held by a waiting request; no slot is over-used."""
    held = sum(e.units for e in running)
    if held + free_units != pool.pool_units or free_units < 0:
        raise AssertionError(f"{pool.label}: {held} held + {free_units} free != {pool.pool_units} units")
    if any(e.units for e in waiting):
        raise AssertionError(f"{pool.label}: a waiting request still holds units")
    if len(running) > pool.max_running:
        raise AssertionError(f"{pool.label}: {len(running)} running > {pool.max_running} slots")
    for entry in running:
        expected = pool.units_for_request(entry.context_tokens)
        if entry.units != expected:
            raise AssertionError(f"{pool.label}: a request holds {entry.units} units, expected {expected}")


def replay_all(
    pools: dict[str, PoolModel], requests: list[TraceRequest], max_model_len: int
) -> dict[str, ReplayResult]:
    return {key: replay(pool, requests, max_model_len) for key, pool in pools.items()}
