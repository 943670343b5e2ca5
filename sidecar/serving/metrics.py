"""Prometheus metrics of the sidecar, one registry for every front door: vLLM's names, so dashboards and the Gateway
API Inference Extension's endpoint picker built for vLLM read ours, plus separate token-pool and state-pool gauges."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridkv.sidecar.core.outputs import STEP_KINDS

# Bucket edges (seconds) of vLLM's TTFT and inter-token histograms.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
# Bucket edges (seconds) of vLLM's request latency histograms (end to end, queue, prefill, decode, inference).
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                             240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector:
    """Gauges and counters read from the engine process's latest stats snapshot at scrape time."""

    def __init__(self, frontend, model_name: str):
        self._frontend = frontend
        self._model_name = model_name

    def collect(self):
        stats = self._frontend.stats
        if stats is None:
            return
        token_usage = stats.used_token_blocks / stats.total_token_blocks if stats.total_token_blocks else 0.0
        state_usage = stats.used_state_slots / stats.total_state_slots if stats.total_state_slots else 0.0
        gauges = (
            ("vllm:num_requests_running", "Requests running (holding a state slot).", stats.running),
            ("vllm:num_requests_waiting", "Requests waiting for a state slot or token blocks.", stats.waiting),
            ("vllm:kv_cache_usage_perc",
             "Cache usage 0-1: the fuller of the token pool and the state pool (what limits admission).",
             max(token_usage, state_usage)),
            ("hybridkv:token_pool_usage_perc", "Attention KV token pool usage, 0-1.", token_usage),
            ("hybridkv:state_pool_usage_perc", "GDN request-constant state pool usage, 0-1.", state_usage),
            ("hybridkv:token_blocks_used", "Token blocks held by live requests.", stats.used_token_blocks),
            ("hybridkv:token_blocks_total", "Usable token blocks (null block excluded).", stats.total_token_blocks),
            ("hybridkv:state_slots_used", "State slots held by running requests.", stats.used_state_slots),
            ("hybridkv:state_slots_total", "Usable state slots (null slot excluded).", stats.total_state_slots),
            ("hybridkv:token_blocks_cached",
             "Token blocks no request holds that keep a cached prefix (reused on a hit, evicted first when short).",
             stats.cached_token_blocks),
            ("hybridkv:checkpoint_slots_used", "Prefix-cache GDN state checkpoints held or being written.",
             stats.used_checkpoint_slots),
            ("hybridkv:checkpoint_slots_total", "Prefix-cache checkpoint slots (0 while prefix caching is off).",
             stats.total_checkpoint_slots),
        )
        for name, documentation, value in gauges:
            yield self._labelled(GaugeMetricFamily, name, documentation, value)
        counters = (
            ("vllm:num_preemptions", "Preemptions (recompute) since start.", stats.preemptions_total),
            ("vllm:prompt_tokens", "Prompt tokens processed since start.", stats.prompt_tokens_total),
            ("vllm:generation_tokens", "Tokens generated since start.", stats.generation_tokens_total),
            ("hybridkv:prefill_held_steps",
             "Steps that held waiting prompts back while requests decoded, to prefill them in a fuller mixed step.",
             stats.prefill_held_steps_total),
            ("hybridkv:tpot_held_steps",
             "Steps that admitted no waiting prompt because the recent steps took longer than --target-tpot-ms.",
             stats.tpot_held_steps_total),
            ("hybridkv:jit_compiles_after_ready", "Triton kernels compiled after ready (each one a stall).",
             stats.jit_compiles_after_ready_total),
            ("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache at admission.",
             stats.prefix_cache_queries_total),
            ("vllm:prefix_cache_hits", "Tokens found in the prefix cache (blocks and a state checkpoint).",
             stats.prefix_cache_hits_total),
            ("hybridkv:prefix_cache_shared_prefix_waits",
             "Steps a waiting request waited for a prefix another request was computing, to resume there.",
             stats.shared_prefix_waits_total),
        )
        for name, documentation, value in counters:
            yield self._labelled(CounterMetricFamily, name, documentation, value)
        by_kind = CounterMetricFamily(
            "hybridkv:prefix_cache_hits_by_kind",
            "Prefix-cache hit tokens by the checkpoint they resumed from: prompt_end, inside_prompt, output_end.",
            labels=("kind",))
        for kind in ("prompt_end", "inside_prompt", "output_end"):
            by_kind.add_metric((kind,), stats.prefix_cache_hits_by_kind.get(kind, 0))
        yield by_kind
        steps = CounterMetricFamily(
            "hybridkv:engine_steps",
            "Engine steps launched, by kind: decode (decodes only, the CUDA-graph path), mixed, prefill.",
            labels=("kind",))
        for kind in STEP_KINDS:
            steps.add_metric((kind,), stats.steps_by_kind_total.get(kind, 0))
        yield steps
        yield CounterMetricFamily("hybridkv:engine_step_seconds", "Seconds the engine loop spent in its steps.",
                                  value=stats.step_seconds_total)
        yield CounterMetricFamily(
            "hybridkv:engine_device_wait_seconds",
            "Of the engine's step seconds, those spent waiting for the device's results: near all of them when the "
            "device sets the pace, near none when the host does.", value=stats.device_wait_seconds_total)

    def _labelled(self, family_type, name: str, documentation: str, value: float):
        """vLLM's series carry `model_name`, which the Gateway API Inference Extension's endpoint picker selects on."""
        if not name.startswith("vllm:"):
            return family_type(name, documentation, value=value)
        family = family_type(name, documentation, labels=("model_name",))
        family.add_metric((self._model_name,), value)
        return family


class ServingMetrics:
    """The registry and the request-level series, fed by the frontend's listeners."""

    def __init__(self, frontend, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(frontend, model_name))
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time from request arrival to its first token.",
            buckets=TTFT_BUCKETS_S, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
            buckets=INTER_TOKEN_BUCKETS_S, registry=self.registry,
        )
        # A request finished after its first token: its time end to end, and in the engine by phase.
        latency = (("e2e_request_latency", "Time from request arrival to its last output."),
                   ("request_queue_time", "Time in the engine's waiting queue before its first step."),
                   ("request_prefill_time", "Time from its first step to its first token (its prompt's steps)."),
                   ("request_decode_time", "Time from its first token to its last."),
                   ("request_inference_time", "Time from its first step to its last token."))
        self.request_latency = {
            name: Histogram(f"vllm:{name}_seconds", documentation, buckets=REQUEST_LATENCY_BUCKETS_S,
                            registry=self.registry)
            for name, documentation in latency}
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason (abort includes client cancels).",
            labelnames=("finished_reason",), registry=self.registry,
        )
        self.cache_config_info = Info(
            "hybridkv:cache_config", "The measured dual-pool cache configuration.", registry=self.registry
        )
        frontend.token_listeners.append(self._observe_tokens)
        frontend.timing_listeners.append(self._observe_timings)
        frontend.finish_listeners.append(lambda reason, _duration_s: self.request_success.labels(
            finished_reason=reason).inc())

    def _observe_tokens(self, arrival_s: float, last_token_s: float | None, num_tokens: int) -> None:
        now_s = time.perf_counter()
        if last_token_s is None:
            self.time_to_first_token.observe(now_s - arrival_s)
        else:
            gap_s = (now_s - last_token_s) / num_tokens
            for _ in range(num_tokens):
                self.inter_token_latency.observe(gap_s)

    def _observe_timings(self, timings, end_to_end_s: float) -> None:
        for name, seconds in (("e2e_request_latency", end_to_end_s), ("request_queue_time", timings.queue_s),
                              ("request_prefill_time", timings.prefill_s), ("request_decode_time", timings.decode_s),
                              ("request_inference_time", timings.inference_s)):
            self.request_latency[name].observe(seconds)

    def describe_cache(self, capacity: dict, model_name: str) -> None:
        self.cache_config_info.info({
            "model_name": model_name,
            "block_size": str(capacity["block_size"]),
            "num_gpu_blocks": str(capacity["token_blocks"]),
            "kv_cache_size_tokens": str(capacity["token_capacity"]),
            "state_slots": str(capacity["state_slots"]),
            "token_pool_bytes": str(capacity["token_pool_bytes"]),
            "state_pool_bytes": str(capacity["state_pool_bytes"]),
            "checkpoint_slots": str(capacity["checkpoint_slots"]),
            "checkpoint_pool_bytes": str(capacity["checkpoint_pool_bytes"]),
            "tensor_parallel_size": str(capacity["tensor_parallel_size"]),
        })
