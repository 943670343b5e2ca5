"""The requests a HybridModel's `serving.workload` describes, and how the dual pool holds them at maxConcurrency.

Distributions become log-normal lengths: σ = 1 with the mean alone, or the σ that puts the given percentile where it
is said to be (mean = exp(μ + σ²/2), p = exp(μ + z·σ)). A histogram is sampled by weight; a trace gives its own
lengths. Every request is queued at step 0, so the replay keeps maxConcurrency requests running whenever the pools
allow: the worst case for memory, and the figure the planner's preemption rate is measured at. The same seed gives
the same requests, so a plan is reproducible.

With `conversations`, the requests are the turns of chats sharing a system prompt (`multi_turn_workload`): a turn's
prompt is the system prompt, the history and a new message of the prompt length, and its reply is of the output
length. Their lengths feed the same replay; with prefix caching on, their ids also size the checkpoint pool
(`size_checkpoint_slots`): the chats are replayed through the dual pool's prefix cache at a ladder of checkpoint
slots per chat, bisected for the fewest slots that hit CHECKPOINT_SIZING_FRACTION of what the most slots hit.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

from hybridkv.sizing.allocators import DUAL_POOL, MAX_CHECKPOINT_SLOTS, PoolModel, pool_model
from hybridkv.sizing.errors import WorkloadError
from hybridkv.sizing.memory import RankBytes
from hybridkv.sizing.prefix import PrefixCacheModel, TokenRequest, multi_turn_workload, replay_prefix
from hybridkv.sizing.simulate import ReplayResult, TraceRequest, replay
from hybridkv.sizing.spec import LengthDistribution, Workload

WORKLOAD_SEED = 0
# Enough requests that each of maxConcurrency slots is refilled several times; bounded so a plan stays fast.
REQUESTS_PER_SLOT = 4
MIN_WORKLOAD_REQUESTS = 256
MAX_WORKLOAD_REQUESTS = 4096
# Sizing the checkpoint pool: at most this many chats are replayed (more at once scale the slots found, as the
# replay's hits depend on slots per chat, not on the number of chats, while the token pool does not bind: 32 and 128
# chats choose the same or a neighbouring count, the larger one taking four times as long); the slots per chat tried;
# and the share of the most slots' hits the chosen count must reach.
SIZING_CONVERSATIONS = 32
CHECKPOINTS_PER_CONVERSATION = (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
CHECKPOINT_SIZING_FRACTION = 0.98


def workload_size(max_concurrency: int) -> int:
    return max(MIN_WORKLOAD_REQUESTS, min(MAX_WORKLOAD_REQUESTS, REQUESTS_PER_SLOT * max_concurrency))


def lognormal_sigma(distribution: LengthDistribution) -> float:
    """σ of the log-normal with this mean through this percentile (1.0 without a percentile)."""
    if distribution.percentile is None:
        return 1.0
    percent, tokens = distribution.percentile
    z = NormalDist().inv_cdf(percent / 100)
    # ln p − ln mean = zσ − σ²/2, so σ = z ± √(z² − 2·gap): the smallest positive root is the lighter tail.
    gap = math.log(tokens / distribution.mean)
    discriminant = z * z - 2 * gap
    roots = [] if discriminant < 0 else [root for root in (z - math.sqrt(discriminant), z + math.sqrt(discriminant))
                                         if root > 0]
    if not roots:
        raise WorkloadError(
            f"no log-normal length has mean {distribution.mean} and p{percent} {tokens}; bring them closer"
        )
    return min(roots)


def _sampler(distribution: LengthDistribution, rng: random.Random):
    sigma = lognormal_sigma(distribution)
    mu = math.log(distribution.mean) - sigma * sigma / 2
    return lambda upper: max(1, min(upper, round(rng.lognormvariate(mu, sigma))))


def workload_requests(
    workload: Workload, max_model_len: int, max_concurrency: int, trace: list[TraceRequest] | None = None
) -> list[TraceRequest]:
    """The requests to replay, all queued at step 0 (see the module docstring)."""
    if workload.trace_config_map_ref is not None:
        if trace is None:
            raise WorkloadError("serving.workload.traceConfigMapRef must be read before planning; pass the trace")
        too_long = [r for r in trace if r.total_tokens > max_model_len]
        if too_long:
            raise WorkloadError(f"the workload trace has {len(too_long)} request(s) longer than serving.maxModelLen "
                                f"{max_model_len}, the first {too_long[0].total_tokens} tokens")
        return [TraceRequest(0, r.prompt_tokens, r.output_tokens) for r in trace]
    count = workload_size(max_concurrency)
    if workload.conversations is not None:
        chats = conversation_requests(workload, max_model_len, -(-count // workload.conversations.turns))
        return [TraceRequest(0, r.prompt_tokens, r.output_tokens) for r in chats]
    rng = random.Random(WORKLOAD_SEED)
    if workload.histogram:
        bins = rng.choices(workload.histogram, weights=[weight for _, _, weight in workload.histogram], k=count)
        return [TraceRequest(0, prompt, output) for prompt, output, _ in bins]
    prompt_length, output_length = _sampler(workload.prompt_tokens, rng), _sampler(workload.output_tokens, rng)
    requests = []
    for _ in range(count):
        prompt = prompt_length(max_model_len - 1)
        requests.append(TraceRequest(0, prompt, output_length(max_model_len - prompt)))
    return requests


def conversation_requests(workload: Workload, max_model_len: int, conversations: int,
                          seed: int = WORKLOAD_SEED) -> list[TokenRequest]:
    """`conversations` chats of `workload.conversations`' shape, every turn that fits in `max_model_len` (the
    planner's are drawn from WORKLOAD_SEED)."""
    shape = workload.conversations
    requests = multi_turn_workload(
        seed, conversations, shape.turns, shape.system_prompt_tokens, workload.prompt_tokens.mean,
        workload.output_tokens.mean, rerendered=shape.rerendered, user_sigma=lognormal_sigma(workload.prompt_tokens),
        output_sigma=lognormal_sigma(workload.output_tokens), max_tokens=max_model_len,
    )
    if not requests:
        raise WorkloadError(f"no turn of serving.workload.conversations fits in serving.maxModelLen {max_model_len}: "
                            "shorten the system prompt or the turns")
    return requests


def describe_workload(workload: Workload, requests: list[TraceRequest]) -> str:
    if workload.trace_config_map_ref is not None:
        source = f"the trace in ConfigMap {workload.trace_config_map_ref.name}"
    elif workload.conversations is not None:
        shape = workload.conversations
        source = (f"chats of up to {shape.turns} turns on a {shape.system_prompt_tokens:,}-token system prompt "
                  f"with the history sent as {shape.history}")
    elif workload.histogram:
        source = f"a {len(workload.histogram)}-bin length histogram"
    else:
        source = "log-normal lengths"
    prompt = sum(r.prompt_tokens for r in requests) / len(requests)
    output = sum(r.output_tokens for r in requests) / len(requests)
    return f"{len(requests):,} requests from {source} (mean prompt {prompt:,.0f}, output {output:,.0f} tokens)"


@dataclass(frozen=True)
class WorkloadCheck:
    """One replay of the workload on a candidate pool."""

    result: ReplayResult
    requests: int
    max_preemption_rate: float

    @property
    def preemption_rate(self) -> float:
        return self.result.preemptions / self.requests

    @property
    def holds(self) -> bool:
        return self.result.refused == 0 and self.preemption_rate <= self.max_preemption_rate

    def to_dict(self) -> dict:
        return {"requests": self.requests, "preemption_rate": round(self.preemption_rate, 6),
                "max_preemption_rate": self.max_preemption_rate, **self.result.to_dict()}


def check_workload(pool: PoolModel, requests: list[TraceRequest], max_model_len: int,
                   max_preemption_rate: float) -> WorkloadCheck:
    return WorkloadCheck(replay(pool, requests, max_model_len), len(requests), max_preemption_rate)


@dataclass(frozen=True)
class CheckpointSizing:
    """The checkpoint slots `size_checkpoint_slots` chose, and the replay that chose them."""

    slots: int
    conversations: int  # chats at once (serving.maxConcurrency)
    replayed_conversations: int  # chats replayed (at most SIZING_CONVERSATIONS)
    tried: tuple[tuple[int, float], ...]  # (slots, prompt tokens hit) of each count replayed, for the replayed chats
    chosen: int  # the count chosen for the replayed chats (scaled to `slots`)

    @property
    def hit_fraction(self) -> float:
        return dict(self.tried)[self.chosen]

    @property
    def best_hit_fraction(self) -> float:
        return max(hit for _, hit in self.tried)

    def to_dict(self) -> dict:
        return {"slots": self.slots, "conversations": self.conversations,
                "replayed_conversations": self.replayed_conversations, "replayed_slots": self.chosen,
                "hit_fraction": round(self.hit_fraction, 4), "best_hit_fraction": round(self.best_hit_fraction, 4),
                "tried": [{"slots": slots, "hit_fraction": round(hit, 4)} for slots, hit in self.tried]}


def size_checkpoint_slots(workload: Workload, rank_bytes: RankBytes, max_model_len: int, max_concurrency: int,
                          block_size: int, checkpoint_interval_tokens: int) -> CheckpointSizing:
    """The fewest checkpoint slots for `workload.conversations` (see the module docstring).

    The replay's token pool holds every token the chats produce, so only the checkpoint slots limit the hits."""
    replayed = min(max_concurrency, SIZING_CONVERSATIONS)
    requests = conversation_requests(workload, max_model_len, replayed)
    tokens = sum(r.total_tokens for r in requests) + replayed * max_model_len
    ladder = sorted({min(MAX_CHECKPOINT_SLOTS, max(1, math.ceil(replayed * per_chat)))
                     for per_chat in CHECKPOINTS_PER_CONVERSATION})
    hits: dict[int, float] = {}

    def hit_fraction(slots: int) -> float:
        if slots not in hits:
            budget = ((-(-tokens // block_size) + 1) * block_size * rank_bytes.bytes_per_token
                      + (replayed + 1 + slots) * rank_bytes.bytes_per_request)
            pool = pool_model(DUAL_POOL, rank_bytes, budget, replayed, block_size, slots)
            model = PrefixCacheModel(pool, block_size, 0, slots, checkpoint_interval_tokens)
            hits[slots] = replay_prefix(model, requests, max_model_len).hit_fraction
        return hits[slots]

    goal = CHECKPOINT_SIZING_FRACTION * hit_fraction(ladder[-1])
    # Bisect the ladder (hits grow with slots): every count tried below the chosen one falls short of the goal.
    low, high = 0, len(ladder) - 1
    while low < high:
        middle = (low + high) // 2
        if hit_fraction(ladder[middle]) >= goal:
            high = middle
        else:
            low = middle + 1
    chosen = ladder[high]
    slots = min(MAX_CHECKPOINT_SLOTS, math.ceil(chosen * max_concurrency / replayed))
    return CheckpointSizing(slots, max_concurrency, replayed, tuple(sorted(hits.items())), chosen)
