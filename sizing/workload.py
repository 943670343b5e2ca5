"""The requests a HybridModel's `serving.workload` describes, and how the dual pool holds them at maxConcurrency.

Distributions become log-normal lengths: σ = 1 with the mean alone, or the σ that puts the given percentile where it
is said to be (mean = exp(μ + σ²/2), p = exp(μ + z·σ)). A histogram is sampled by weight; a trace gives its own
lengths. Every request is queued at step 0, so the replay keeps maxConcurrency requests running whenever the pools
allow: the worst case for memory, and the figure the planner's preemption rate is measured at. The same seed gives
the same requests, so a plan is reproducible.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

from hybridkv.sizing.allocators import PoolModel
from hybridkv.sizing.errors import WorkloadError
from hybridkv.sizing.simulate import ReplayResult, TraceRequest, replay
from hybridkv.sizing.spec import LengthDistribution, Workload

WORKLOAD_SEED = 0
# Enough requests that each of maxConcurrency slots is refilled several times; bounded so a plan stays fast.
REQUESTS_PER_SLOT = 4
MIN_WORKLOAD_REQUESTS = 256
MAX_WORKLOAD_REQUESTS = 4096


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
    rng = random.Random(WORKLOAD_SEED)
    count = workload_size(max_concurrency)
    if workload.histogram:
        bins = rng.choices(workload.histogram, weights=[weight for _, _, weight in workload.histogram], k=count)
        return [TraceRequest(0, prompt, output) for prompt, output, _ in bins]
    prompt_length, output_length = _sampler(workload.prompt_tokens, rng), _sampler(workload.output_tokens, rng)
    requests = []
    for _ in range(count):
        prompt = prompt_length(max_model_len - 1)
        requests.append(TraceRequest(0, prompt, output_length(max_model_len - prompt)))
    return requests


def describe_workload(workload: Workload, requests: list[TraceRequest]) -> str:
    if workload.trace_config_map_ref is not None:
        source = f"the trace in ConfigMap {workload.trace_config_map_ref.name}"
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
