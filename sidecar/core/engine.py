"""The engine: requests in, tokens out, over the dual-pool cache.

`add_request` and `abort` may be called from any thread: they only touch a locked inbox that `step()` drains first, so
the scheduler and the pools are only ever changed by the thread running `step()`.

Steps overlap: `step()` schedules and launches step n+1 on the device before it reads step n's sampled ids, then
does step n's host work (stop checks, detokenizing, outputs) while the device runs step n+1. Decode rows of step n+1
read the ids they need from the device (`ModelRunner.record_sampled`), so the device never waits for the host. The
price is that a request stopped by step n's token has already run in step n+1; that row's token is dropped, and the
request's slot and blocks are freed behind it in the device's stream order. Tensor-parallel engines overlap the same
way: rank 0 broadcasts each step's sampled ids from the device, and every rank keeps them by slot.

One exception: a step with prefill runs its token mixers eagerly, and launching it often takes the host longer than
the device takes to run it. When such a step is next and the device has already finished step n, step n's ids are
read first, so its tokens do not wait behind those launches (the device is idle either way); the requests they
finished leave the new step before it launches. And when the device finishes step n while step n+1 is being
launched through the piecewise graphs (a mixed step of a few prompt tokens, whose launch is the host's bound),
step n's ids are read between two layers (`BatchContext.between_layers`) and its outputs go to `output_sink` at
once, rather than after the rest of the launch: a request's first token, and every decoding request's next one, no
longer wait for that host work (larger prefill steps, launched eagerly, read after the launch). A request those ids
finish has its rows in step n+1 already launched; they run, and their tokens are dropped, as for any request
stopped a step early. On CPU a step has finished when its launch returns, so there step n is always read at step
n+1's first layer, which the CPU tests exercise. Tensor-parallel engines read after the launch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hybridkv.kernels import kernel_mode
from hybridkv.sidecar.core.cache import TORCH_DTYPES, CacheManager
from hybridkv.sidecar.core.config import (DEFAULT_CPU_KV_CACHE_MEMORY_BYTES, DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES,
                                          DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES_CACHED, ConfigError, EngineConfig)
from hybridkv.sidecar.core.outputs import (STEP_KINDS, Completion, EngineStats, RequestOutput, RequestTimings,
                                           step_kind)
from hybridkv.sidecar.execution.runner import ModelRunner, StepBatch
from hybridkv.sidecar.core.outputs import TokenLogprobs
from hybridkv.sidecar.core.sampler import (IncrementalDetokenizer, SampledTokens, Sampler, SamplingState,
                                           detokenize_step)
from hybridkv.sidecar.core.sampling import RequestError, SamplingParams, validate_request
from hybridkv.sidecar.core.scheduler import Scheduler
from hybridkv.sidecar.core.sequence import Sequence
from hybridkv.sidecar.model.tokenizer import Tokenizer
from hybridkv.sidecar.execution.warmup import JitCompileCounter, KernelShapes, warmup_batch, warmup_plan
from hybridkv.sidecar.execution.workers import TensorParallelExecutor

log = logging.getLogger(__name__)


class StartupClock:
    """Consecutive start-up phases: each lap is the time since the previous one, so the laps sum to the whole."""

    def __init__(self):
        self._last_s = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        now_s = time.perf_counter()
        self.phases.append((name, now_s - self._last_s))
        self._last_s = now_s


def format_startup_phases(phases: list[tuple[str, float]]) -> str:
    """The phases as an aligned table with each one's share of the total."""
    total_s = sum(seconds for _, seconds in phases) or 1.0
    width = max(len(name) for name, _ in phases)
    lines = [f"  {'phase':<{width}}  seconds  share"]
    lines += [f"  {name:<{width}}  {seconds:7.2f}  {100 * seconds / total_s:4.0f}%" for name, seconds in phases]
    return "\n".join(lines)

_MEASURED_KEYS = ("block_size", "token_blocks", "token_capacity", "state_slots", "token_pool_bytes",
                  "state_pool_bytes", "checkpoint_slots", "checkpoint_pool_bytes", "budget_bytes", "weights_bytes",
                  "reserve_bytes")


@dataclass(frozen=True)
class CapacityReport:
    """Measured pools (the minimum over ranks) and per rank, the planner's per-rank prediction for the same
    settings, usage."""

    block_size: int
    token_blocks: int
    token_capacity: int
    state_slots: int
    token_pool_bytes: int  # allocated, null block included
    state_pool_bytes: int  # allocated, null slot included
    budget_bytes: int
    weights_bytes: int
    reserve_bytes: int
    tensor_parallel_size: int
    predicted: dict
    usage: dict
    checkpoint_slots: int = 0  # prefix-cache checkpoints in the request-constant memory (0: prefix caching off)
    checkpoint_pool_bytes: int = 0
    checkpoint_attention_tokens: int = 0  # attention tokens the checkpoint pool's bytes would otherwise hold
    memory_measured: bool = True
    per_rank: tuple[dict, ...] = ()  # tensor-parallel ranks, rank 0 first; empty for a single rank

    def to_dict(self) -> dict:
        measured = {key: getattr(self, key) for key in _MEASURED_KEYS}
        return {
            **measured,
            "checkpoint_attention_tokens": self.checkpoint_attention_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
            "per_rank": [dict(rank) for rank in self.per_rank] or [measured],
            "predicted": dict(self.predicted),
            "usage": dict(self.usage),
        }


@dataclass
class _Request:
    seq: Sequence
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer
    emitted_tokens: int = 0


@dataclass
class _LaunchedStep:
    """A step on the device whose sampled ids the host has not read yet: one row per sampled request."""

    requests: list[_Request]
    sampled: SampledTokens  # on the host (pinned on CUDA); valid once `ready` has completed
    ready: torch.cuda.Event | None


class Engine:
    def __init__(self, config: EngineConfig):
        clock = StartupClock()
        from hybridkv.sizing import byte_model, dual_pool_layout, geometry_from_config, kv_cache_dtype
        from hybridkv.sizing.quantization import with_checkpoint_bytes

        config.validate()
        self.geometry = geometry_from_config(config.read_model_config(), name=os.path.basename(
            os.path.normpath(config.model)))
        if config.load_format != "random":  # the prediction counts the weights the checkpoint's headers hold
            self.geometry = with_checkpoint_bytes(self.geometry, config.model)
        self.device = _resolve_device(config.device)
        # Installed once the configuration is accepted (a refused one leaves no hook behind), before anything compiles.
        self.jit_compiles = JitCompileCounter()
        self.jit_compiles.install()
        if self.device.type != "cuda" and config.kv_cache_memory_bytes is None:
            config = replace(config, kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_MEMORY_BYTES)
        self.config = config
        self.dtype_name = self.geometry.dtype if config.dtype == "auto" else config.dtype
        self.ssm_dtype_name = config.ssm_dtype or self.geometry.mamba_ssm_dtype or "float32"
        self.kv_dtype_name = kv_cache_dtype(config.kv_cache_dtype, self.dtype_name)
        dtype = TORCH_DTYPES[self.dtype_name]
        torch.manual_seed(config.seed)
        clock.lap("configuration")
        self.tokenizer = Tokenizer(config.model)
        clock.lap("tokenizer")
        # One rank runs in this process; more ranks add worker processes that step with it.
        if config.tensor_parallel_size > 1:
            self.executor = TensorParallelExecutor(config, self.geometry, self.device, dtype)
            self.runner = self.executor
        else:
            self.executor = None
            self.runner = ModelRunner(config, self.geometry, self.device, dtype)
        clock.lap("random weights" if config.load_format == "random" else "weights")
        self.rank_bytes = byte_model(self.geometry, tp=config.tensor_parallel_size, kv_dtype=self.kv_dtype_name,
                                     conv_dtype=self.dtype_name, ssm_dtype=self.ssm_dtype_name)
        shapes = self.rank_bytes.pool_shapes
        self.sampler = Sampler(self.device, config.seed)
        model_len_limit = config.max_model_len or self.geometry.max_position_embeddings
        self.memory = self.runner.measure_memory(shapes, model_len_limit, self.sampler)
        clock.lap("memory profiling")
        self.layout = dual_pool_layout(self.rank_bytes, self.memory.budget_bytes, config.max_num_seqs,
                                       config.block_size, config.checkpoint_slots)
        self.max_model_len = self._resolve_max_model_len()
        self.cache = CacheManager(self.layout.token_blocks, self.layout.state_slots, config.block_size, shapes,
                                  self.device, self.layout.checkpoint_slots, config.prefix_checkpoint_interval)
        allocated = (self.cache.token_pool_bytes, self.cache.state_pool_bytes, self.cache.checkpoint_pool_bytes)
        modelled = (self.layout.token_pool_bytes, self.layout.state_pool_bytes, self.layout.checkpoint_pool_bytes)
        if allocated != modelled:
            raise RuntimeError(f"pool tensors {allocated} B differ from the byte model {modelled} B "
                               "(token, state, checkpoint pools)")
        clock.lap("pool allocation")
        self.runner.bind(self.cache, self.max_model_len)
        clock.lap("CUDA graph capture" if self.runner.graphs else "pool binding")
        if self.device.type == "cuda":
            self.warm_up()
            clock.lap("warm-up compiles")
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.max_prefill_tokens_with_decodes,
                                   self._min_prefill_tokens_with_decodes(), config.max_prefill_wait_steps,
                                   (config.target_tpot_ms or 0.0) / 1000)
        self.overlap_steps = True  # False resolves each step before the next (the reference for the overlap tests)
        self._launched: _LaunchedStep | None = None
        # Where outputs read between two layers of a launch go at once (the engine process sends them to the server);
        # None: step() returns them with the rest.
        self.output_sink: Callable[[list[RequestOutput]], None] | None = None
        self._read_early: list[RequestOutput] = []
        # Seconds step() spent waiting for the device's sampled ids: near a step's whole time when the device is the
        # bottleneck, near zero when the host is (benchmarks read it), and step()'s own seconds and launches by kind.
        self.device_wait_s = 0.0
        self.step_s = 0.0
        self.steps_by_kind: dict[str, int] = dict.fromkeys(STEP_KINDS, 0)
        self.prediction = self._predict()
        self._lock = threading.Lock()
        self._inbox: list[Sequence | str] = []  # a Sequence to add, or the id of a request to abort
        self._live_ids: set[str] = set()
        self._requests: dict[str, _Request] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        clock.lap("scheduler and prediction")
        self.startup_phases = clock.phases
        log.info("ready in %.2f s:\n%s", sum(seconds for _, seconds in self.startup_phases),
                 format_startup_phases(self.startup_phases))
        self.jit_compiles.mark_ready()

    def _min_prefill_tokens_with_decodes(self) -> int:
        """Holding prefill back pays where a mixed step costs more than its tokens: where pure decode steps replay
        CUDA graphs and mixed ones run eagerly. Without graphs every step runs eagerly, and nothing is held."""
        if self.config.min_prefill_tokens_with_decodes is not None:
            return self.config.min_prefill_tokens_with_decodes
        if not self.runner.graphs:
            return 0
        hold = (DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES_CACHED if self.config.enable_prefix_caching
                else DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES)
        # Holding for more tokens than one mixed step may take would only delay them.
        return min(hold, self.config.max_prefill_tokens_with_decodes or self.config.max_num_batched_tokens)

    def warm_up(self) -> None:
        """Run every kernel configuration serving can meet (`warmup_plan`) and each sampler path, on the null slot
        and block, so nothing compiles after ready."""
        from hybridkv.kernels.triton_utils import device_limits

        geometry, tp = self.geometry, self.config.tensor_parallel_size
        multiprocessors, shared_memory_bytes = device_limits(self.device)
        kv_bytes = TORCH_DTYPES[self.dtype_name].itemsize
        shapes = KernelShapes(
            num_kv_heads=max(1, geometry.num_key_value_heads // tp),
            attention_group=(geometry.num_attention_heads // tp) // max(1, geometry.num_key_value_heads // tp),
            head_dim=geometry.head_dim, kv_element_bytes=kv_bytes, block_size=self.config.block_size,
            num_v_heads=geometry.linear_num_value_heads // tp, head_k_dim=geometry.linear_key_head_dim,
            head_v_dim=geometry.linear_value_head_dim, state_element_bytes=kv_bytes,
            # The shared expert, when it is the stack's last, is one more expert and one more choice per token.
            num_experts=geometry.num_experts + geometry.shared_expert_in_stack if geometry.is_moe else 0,
            experts_per_token=geometry.num_experts_per_tok + geometry.shared_expert_in_stack if geometry.is_moe
            else 0,
            multiprocessors=multiprocessors, shared_memory_bytes=shared_memory_bytes)
        plan = warmup_plan(shapes, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len,
                           graphs=bool(self.runner.graphs))
        logits = None
        for step in plan:
            logits = self.runner.execute(warmup_batch(step, self.config.block_size))
        paths = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
                 SamplingParams(temperature=0.8, top_k=20, top_p=0.9), SamplingParams(temperature=0.8, seed=0)]
        if logits is not None:
            rows = logits[:1].expand(len(paths), -1)
            self.sampler.sample(rows, [self.sampler.new_state(params) for params in paths])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("warm-up ran %d steps covering every kernel configuration; %d Triton compiles", len(plan),
                 self.jit_compiles.compiles_total)

    def _resolve_max_model_len(self) -> int:
        capacity = self.layout.token_capacity
        limit = self.config.max_model_len
        if limit is None:
            return min(self.geometry.max_position_embeddings, capacity)
        if limit > self.geometry.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={limit} exceeds the model's max_position_embeddings "
                f"({self.geometry.max_position_embeddings}); lower --max-model-len"
            )
        if limit > capacity:
            raise ConfigError(
                f"max_model_len={limit} needs {limit} tokens but the token pool holds {capacity} "
                f"({self.layout.token_blocks} blocks of {self.layout.block_size}); lower --max-model-len or "
                "--max-num-seqs, or give the cache more memory"
            )
        return limit

    def _predict(self):
        from hybridkv.sizing import predict_capacity

        total = self.memory.total_memory_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return predict_capacity(
            self.geometry, self.config.tensor_parallel_size, total_memory_bytes=total,
            gpu_memory_utilization=self.config.gpu_memory_utilization, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens, block_size=self.config.block_size,
            kv_cache_memory_bytes=self.config.kv_cache_memory_bytes, kv_dtype=self.kv_dtype_name,
            ssm_dtype=self.ssm_dtype_name, checkpoint_slots=self.config.checkpoint_slots,
            piecewise_tokens=self._piecewise_tokens(),
        )

    def _piecewise_tokens(self) -> int:
        """The largest step replayed piecewise as CUDA graphs (0: none)."""
        piecewise = self.runner.piecewise
        return piecewise.max_tokens if piecewise is not None else 0

    # --- requests (any thread) ---
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        prompt = list(prompt_token_ids)
        validate_request(request_id, prompt, params, self.max_model_len, self.geometry.vocab_size)
        with self._lock:
            if request_id in self._live_ids:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
            self._inbox.append(Sequence(request_id, prompt, params))

    def abort(self, request_id: str) -> bool:
        """Ask to abort; True if the request is still live. Its slot and blocks are freed at the next step."""
        with self._lock:
            if request_id not in self._live_ids:
                return False
            self._inbox.append(request_id)
            return True

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    # --- the step loop (one thread) ---
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then return the outputs of the step launched before it (and of aborts)."""
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_s += time.perf_counter() - started

    def _step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        chunks = self.scheduler.schedule()
        if (self._launched is not None and self.overlap_steps and _has_prefill(chunks)
                and self._device_finished(self._launched)):
            # A step with prefill launches eagerly or piecewise, often longer on the host than on the device: with
            # the device already idle, the finished step's tokens go out first rather than after those launches.
            # Requests they finished have released what they held, so their rows leave this step.
            outputs.extend(self._resolve(self._launched))
            self._launched = None
            chunks = [chunk for chunk in chunks if not chunk.seq.finished]
        launched = self._launch(chunks) if chunks else None
        outputs.extend(self._read_early)
        self._read_early = []
        if self._launched is not None:
            outputs.extend(self._resolve(self._launched))
            self._launched = None
        if launched is not None:
            if self.overlap_steps:
                self._launched = launched
            else:
                outputs.extend(self._resolve(launched))
        return outputs

    def _launch(self, chunks) -> _LaunchedStep:
        """Run the chunks' tokens and sample, without waiting for the device; the sampled ids become pending. The
        step launched before is read between two layers if the device finishes it meanwhile (`_read_if_finished`)."""
        batch = StepBatch.from_chunks(chunks)
        self.steps_by_kind[step_kind(batch.num_decodes, batch.num_seqs)] += 1
        # Taken before the launch: a request the previous step's ids finish during it is forgotten then.
        requests = [self._requests[chunks[index].seq.request_id] for index in batch.sample_indices]
        logits = self.runner.execute(batch, self._read_if_finished if self._reads_between_layers(batch) else None)
        sampled = self.sampler.sample(logits, [request.sampling for request in requests])
        if self.overlap_steps:
            self.runner.record_sampled(sampled.token_ids)
        self.scheduler.launched(chunks)
        for request in requests:
            if not request.seq.finished:
                request.seq.num_pending_tokens += 1
        ready = None
        if sampled.token_ids.is_cuda:
            sampled, ready = sampled.to_host(), torch.cuda.Event()
            ready.record()
        return _LaunchedStep(requests, sampled, ready)

    def _reads_between_layers(self, batch: StepBatch) -> bool:
        """Whether the launch of `batch` reads the step before it between two layers: with a step in flight, on one
        rank, and on a GPU only for a step run through the piecewise graphs, whose launch is the host's bound; a
        larger prefill step, launched eagerly, gives the device more work than its launch, and the previous step's
        output work there would delay the launch the device waits on (on an H100, uncached phases' TTFT p50 rose
        4-10 % reading between layers of every step; docs/performance.md). On CPU every step, so the tests run it."""
        if self._launched is None or not self.overlap_steps or self.executor is not None:
            return False
        return self.device.type != "cuda" or self.runner.runs_piecewise(batch)

    def _read_if_finished(self) -> None:
        """Between two layers of a launch: read the step launched before once the device has finished it (on CPU,
        always), its outputs to `output_sink` (or kept for step() to return)."""
        launched = self._launched
        if launched is None or (launched.ready is not None and not launched.ready.query()):
            return
        self._launched = None
        outputs = self._resolve(launched, finished=True)
        if self.output_sink is not None and outputs:
            self.output_sink(outputs)
        else:
            self._read_early.extend(outputs)

    @staticmethod
    def _device_finished(launched: _LaunchedStep) -> bool:
        """The launched step's ids are on the host already (a CUDA event that has completed). On CPU a step has
        finished when `_launch` returns; the overlap order is kept there, so the same tests cover it."""
        return launched.ready is not None and launched.ready.query()

    def _resolve(self, launched: _LaunchedStep, finished: bool = False) -> list[RequestOutput]:
        """Read a launched step's ids and apply them to the requests still live (in step order, so each fills the
        oldest pending token of its request); `finished`: its event has completed, nothing to wait for."""
        if launched.ready is not None and not finished:
            started = time.perf_counter()
            launched.ready.synchronize()
            self.device_wait_s += time.perf_counter() - started
            if self.executor is not None:
                self.executor.check_collectives()  # ids of a step whose collectives were aborted are not tokens
        sampled = launched.sampled
        live = [row for row in zip(launched.requests, sampled.token_ids.tolist(), sampled.logprobs_per_row())
                if not row[0].seq.finished]  # the others were aborted, or stopped by an earlier step's token
        return self._append_tokens([row[0] for row in live], [row[1] for row in live], [row[2] for row in live])

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outputs = []
        for item in inbox:
            if isinstance(item, Sequence):
                self._requests[item.request_id] = _Request(
                    item, self.sampler.new_state(item.params, item.prompt_token_ids, self.tokenizer.eos_token_ids),
                    IncrementalDetokenizer(item.params.stop, item.params.min_tokens,
                                           item.params.include_stop_str_in_output))
                self.scheduler.add(item)
            else:
                seq = self.scheduler.abort(item)
                if seq is not None:
                    request = self._requests[seq.request_id]
                    request.detokenizer.flush(self.tokenizer)
                    outputs.append(self._output(request, []))
                    self._forget(seq)
        return outputs

    def _append_tokens(self, requests: list[_Request], tokens: list[int],
                       logprobs: list[TokenLogprobs | None]) -> list[RequestOutput]:
        """Detokenize each request's sampled token and find the stops; the scheduler then applies them."""
        seqs = [request.seq for request in requests]
        stopped = [seq.stops_on(token, self.tokenizer.eos_token_ids) for seq, token in zip(seqs, tokens)]
        # The text of a stop token is not part of the output; every other token goes through the detokenizer.
        to_detokenize = [i for i, stop in enumerate(stopped) if not stop]
        if to_detokenize:
            hits = detokenize_step(self.tokenizer, [requests[i].detokenizer for i in to_detokenize],
                                   [tokens[i] for i in to_detokenize])
            for index, hit in zip(to_detokenize, hits):
                stopped[index] = hit
        reasons = self.scheduler.postprocess(seqs, tokens, stopped)
        self.generation_tokens_total += len(tokens)
        outputs = []
        now_s = time.monotonic()
        for request, reason, token_logprobs in zip(requests, reasons, logprobs):
            seq = request.seq
            if seq.num_completion_tokens == 1:
                self.prompt_tokens_total += seq.num_prompt_tokens
                seq.first_token_s = now_s
            new_tokens = seq.token_ids[seq.num_prompt_tokens + request.emitted_tokens:]
            request.emitted_tokens = seq.num_completion_tokens
            if reason is not None:
                self._forget(seq)
                request.detokenizer.flush(self.tokenizer)
            outputs.append(self._output(request, new_tokens, None if token_logprobs is None else [token_logprobs],
                                        now_s))
        return outputs

    def _output(self, request: _Request, new_tokens: list[int], logprobs: list[TokenLogprobs] | None = None,
                now_s: float | None = None) -> RequestOutput:
        seq = request.seq
        timings = None
        if seq.finished and seq.first_token_s is not None:  # scheduled, then had a first token
            timings = RequestTimings(queue_s=seq.scheduled_s - seq.arrival_s,
                                     prefill_s=seq.first_token_s - seq.scheduled_s,
                                     decode_s=(now_s or time.monotonic()) - seq.first_token_s)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            text_delta=request.detokenizer.delta(seq.finished),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens,
            cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            timings=timings,
        )

    def _forget(self, seq: Sequence) -> None:
        del self._requests[seq.request_id]
        with self._lock:
            self._live_ids.discard(seq.request_id)

    # --- offline ---
    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run `prompts` to completion (texts are tokenized without special tokens); results in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params_list)} sampling parameter sets")
        prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        request_ids = [f"generate-{id(self)}-{index}" for index in range(len(prompts))]
        for request_id, ids, request_params in zip(request_ids, prompt_ids, params_list):
            self.add_request(request_id, ids, request_params)
        tokens = {request_id: [] for request_id in request_ids}
        texts = {request_id: [] for request_id in request_ids}
        logprobs = {request_id: [] for request_id in request_ids}
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(request_ids):
            for output in self.step():
                if output.request_id in tokens:
                    tokens[output.request_id].extend(output.new_token_ids)
                    texts[output.request_id].append(output.text_delta)
                    logprobs[output.request_id].extend(output.logprobs or [])
                    if output.finished:
                        finals[output.request_id] = output
        return [
            Completion(request_id, ids, tokens[request_id], "".join(texts[request_id]),
                       finals[request_id].finish_reason, finals[request_id].prompt_tokens,
                       finals[request_id].completion_tokens,
                       logprobs[request_id] if request_params.logprobs is not None else None,
                       finals[request_id].cached_tokens)
            for request_id, ids, request_params in zip(request_ids, prompt_ids, params_list)
        ]

    # --- reports ---
    def capacity(self) -> CapacityReport:
        layout, prediction = self.layout, self.prediction
        predicted_layout = prediction.layout
        return CapacityReport(
            block_size=layout.block_size,
            token_blocks=layout.token_blocks,
            token_capacity=layout.token_capacity,
            state_slots=layout.state_slots,
            token_pool_bytes=self.cache.token_pool_bytes,
            state_pool_bytes=self.cache.state_pool_bytes,
            budget_bytes=self.memory.budget_bytes,
            weights_bytes=self.memory.weights_bytes,
            reserve_bytes=self.memory.reserve_bytes,
            tensor_parallel_size=self.config.tensor_parallel_size,
            checkpoint_slots=layout.checkpoint_slots,
            checkpoint_pool_bytes=self.cache.checkpoint_pool_bytes,
            checkpoint_attention_tokens=layout.checkpoint_attention_tokens,
            predicted={
                "weights_bytes": prediction.weights_bytes,
                "reserve_bytes": prediction.reserve_bytes,
                "budget_bytes": prediction.budget_bytes,
                "token_blocks": predicted_layout.token_blocks,
                "token_capacity": predicted_layout.token_capacity,
                "state_slots": predicted_layout.state_slots,
                "token_pool_bytes": predicted_layout.token_pool_bytes,
                "state_pool_bytes": predicted_layout.state_pool_bytes,
                "checkpoint_slots": predicted_layout.checkpoint_slots,
                "checkpoint_pool_bytes": predicted_layout.checkpoint_pool_bytes,
            },
            usage={
                "used_token_blocks": self.cache.blocks.num_used_blocks,
                "cached_token_blocks": self.cache.blocks.num_cached_blocks,
                "used_state_slots": self.cache.slots.num_used_slots,
                "used_checkpoint_slots": self.cache.checkpoints.num_keyed + self.cache.checkpoints.num_pending,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
            },
            memory_measured=self.memory.measured,
            per_rank=tuple(self.executor.per_rank_capacity()) if self.executor is not None else (),
        )

    def stats(self) -> EngineStats:
        """Raises WorkerFailedError once a tensor-parallel worker has died, even between steps."""
        if self.executor is not None:
            self.executor.check_workers()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            used_token_blocks=self.cache.blocks.num_used_blocks,
            total_token_blocks=self.layout.token_blocks,
            used_state_slots=self.cache.slots.num_used_slots,
            total_state_slots=self.layout.state_slots,
            preemptions_total=self.scheduler.preemptions_total,
            prefill_held_steps_total=self.scheduler.held_steps_total,
            tpot_held_steps_total=self.scheduler.tpot_held_steps_total,
            cached_token_blocks=self.cache.blocks.num_cached_blocks,
            used_checkpoint_slots=self.cache.checkpoints.num_keyed + self.cache.checkpoints.num_pending,
            total_checkpoint_slots=self.layout.checkpoint_slots,
            prefix_cache_queries_total=self.scheduler.prefix_queried_tokens,
            prefix_cache_hits_total=self.scheduler.prefix_hit_tokens,
            prefix_cache_hits_by_kind=dict(self.scheduler.prefix_hit_tokens_by_kind),
            shared_prefix_waits_total=self.scheduler.shared_prefix_waits_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            jit_compiles_after_ready_total=self.jit_compiles.compiles_after_ready,
            steps_by_kind_total=dict(self.steps_by_kind),
            step_seconds_total=self.step_s,
            device_wait_seconds_total=self.device_wait_s,
        )

    def model_info(self) -> dict:
        return {
            "model": self.config.model,
            "name": self.geometry.name,
            "model_type": self.geometry.model_type,
            "dtype": self.dtype_name,
            "ssm_dtype": self.ssm_dtype_name,
            "device": str(self.device),
            "vocab_size": self.geometry.vocab_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "max_prefill_tokens_with_decodes": self.config.max_prefill_tokens_with_decodes,
            "min_prefill_tokens_with_decodes": self.scheduler.min_prefill_tokens_with_decodes,
            "max_prefill_wait_steps": self.scheduler.max_prefill_wait_steps,
            "target_tpot_ms": self.config.target_tpot_ms,
            "block_size": self.config.block_size,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "num_full_attention_layers": self.geometry.num_full_attention_layers,
            "num_linear_attention_layers": self.geometry.num_linear_attention_layers,
            "eos_token_ids": list(self.tokenizer.eos_token_ids),
            "cuda_graphs": bool(self.runner.graphs),
            "piecewise_cuda_graph_max_tokens": self._piecewise_tokens(),
            "startup_phases": [{"name": name, "seconds": seconds} for name, seconds in self.startup_phases],
        }

    def check_invariants(self) -> None:
        """Raise PoolInvariantError unless the pools match what the live requests hold."""
        self.cache.check_invariants(self.scheduler.live_sequences())
        if self.executor is not None:
            self.executor.check_pools()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and the compile counting; the engine cannot step afterwards."""
        if self.executor is not None:
            self.executor.shutdown()
        self.jit_compiles.uninstall()


def _has_prefill(chunks) -> bool:
    """Some chunk runs more than one token: a mixed or prefill step, not a CUDA-graph decode replay. (A one-token
    prompt chunk counts as a decode row, as the batch layout runs it.)"""
    return any(chunk.num_tokens > 1 for chunk in chunks)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for but no CUDA GPU is visible; use --device cpu")
    if resolved.type == "cpu" and kernel_mode() == "triton":
        # On CPU, Triton means its interpreter, and fla's chunk stages of the GDN prefill do not run there.
        raise ConfigError("HYBRIDKV_KERNELS=triton cannot serve on the CPU: the GDN prefill's fla stages do not run "
                          "under the Triton interpreter; unset it (auto takes the reference kernels on CPU) or serve "
                          "on a CUDA device")
    return resolved
