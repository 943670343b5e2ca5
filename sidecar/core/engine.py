"""The engine: requests in, tokens out, over the dual-pool cache.

`add_request` and `abort` may be called from any thread: they only touch a locked inbox that `step()` drains first, so
the scheduler and the pools are only ever changed by the thread running `step()`.

Steps overlap: `step()` schedules and launches step n+1 on the device before it reads step n's sampled ids, then
does step n's host work (stop checks, detokenizing, outputs) while the device runs step n+1. Decode rows of step n+1
read the ids they need from the device (`ModelRunner.record_sampled`), so the device never waits for the host. The
price is that a request stopped by step n's token has already run in step n+1; that row's token is dropped, and the
request's slot and blocks are freed behind it in the device's stream order. Tensor-parallel engines overlap the same
way: rank 0 broadcasts each step's sampled ids from the device, and every rank keeps them by slot.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace

import torch

from hybridkv.sidecar.core.cache import TORCH_DTYPES, CacheManager
from hybridkv.sidecar.core.config import DEFAULT_CPU_KV_CACHE_MEMORY_BYTES, ConfigError, EngineConfig
from hybridkv.sidecar.core.outputs import Completion, EngineStats, RequestOutput
from hybridkv.sidecar.execution.runner import ModelRunner, StepBatch
from hybridkv.sidecar.core.sampler import IncrementalDetokenizer, Sampler, SamplingState, detokenize_step
from hybridkv.sidecar.core.sampling import RequestError, SamplingParams, validate_request
from hybridkv.sidecar.core.scheduler import Scheduler
from hybridkv.sidecar.core.sequence import Sequence
from hybridkv.sidecar.model.tokenizer import Tokenizer
from hybridkv.sidecar.execution.workers import TensorParallelExecutor

_MEASURED_KEYS = ("block_size", "token_blocks", "token_capacity", "state_slots", "token_pool_bytes",
                  "state_pool_bytes", "budget_bytes", "weights_bytes", "reserve_bytes")


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
    memory_measured: bool = True
    per_rank: tuple[dict, ...] = ()  # tensor-parallel ranks, rank 0 first; empty for a single rank

    def to_dict(self) -> dict:
        measured = {key: getattr(self, key) for key in _MEASURED_KEYS}
        return {
            **measured,
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
    tokens: torch.Tensor  # on the host (pinned on CUDA); valid once `ready` has completed
    ready: torch.cuda.Event | None


class Engine:
    def __init__(self, config: EngineConfig):
        from hybridkv.sizing import byte_model, dual_pool_layout, geometry_from_config

        config.validate()
        self.geometry = geometry_from_config(config.read_model_config(), name=os.path.basename(
            os.path.normpath(config.model)))
        self.device = _resolve_device(config.device)
        if self.device.type != "cuda" and config.kv_cache_memory_bytes is None:
            config = replace(config, kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_MEMORY_BYTES)
        self.config = config
        self.dtype_name = self.geometry.dtype if config.dtype == "auto" else config.dtype
        self.ssm_dtype_name = config.ssm_dtype or self.geometry.mamba_ssm_dtype or "float32"
        dtype = TORCH_DTYPES[self.dtype_name]
        torch.manual_seed(config.seed)
        self.tokenizer = Tokenizer(config.model)
        # One rank runs in this process; more ranks add worker processes that step with it.
        if config.tensor_parallel_size > 1:
            self.executor = TensorParallelExecutor(config, self.geometry, self.device, dtype)
            self.runner = self.executor
        else:
            self.executor = None
            self.runner = ModelRunner(config, self.geometry, self.device, dtype)
        self.rank_bytes = byte_model(self.geometry, tp=config.tensor_parallel_size, kv_dtype=self.dtype_name,
                                     conv_dtype=self.dtype_name, ssm_dtype=self.ssm_dtype_name)
        shapes = self.rank_bytes.pool_shapes
        self.sampler = Sampler(self.device, config.seed)
        model_len_limit = config.max_model_len or self.geometry.max_position_embeddings
        self.memory = self.runner.measure_memory(shapes, model_len_limit, self.sampler)
        self.layout = dual_pool_layout(self.rank_bytes, self.memory.budget_bytes, config.max_num_seqs,
                                       config.block_size)
        self.max_model_len = self._resolve_max_model_len()
        self.cache = CacheManager(self.layout.token_blocks, self.layout.state_slots, config.block_size, shapes,
                                  self.device)
        if (self.cache.token_pool_bytes, self.cache.state_pool_bytes) != (
                self.layout.token_pool_bytes, self.layout.state_pool_bytes):
            raise RuntimeError(
                f"pool tensors ({self.cache.token_pool_bytes} + {self.cache.state_pool_bytes} B) differ from the byte "
                f"model ({self.layout.token_pool_bytes} + {self.layout.state_pool_bytes} B)"
            )
        self.runner.bind(self.cache, self.max_model_len)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        self.overlap_steps = True  # False resolves each step before the next (the reference for the overlap tests)
        self._launched: _LaunchedStep | None = None
        # Seconds step() spent waiting for the device's sampled ids: near a step's whole time when the device is the
        # bottleneck, near zero when the host is (benchmarks read it).
        self.device_wait_s = 0.0
        self.prediction = self._predict()
        self._lock = threading.Lock()
        self._inbox: list[Sequence | str] = []  # a Sequence to add, or the id of a request to abort
        self._live_ids: set[str] = set()
        self._requests: dict[str, _Request] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

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
            kv_cache_memory_bytes=self.config.kv_cache_memory_bytes, kv_dtype=self.dtype_name,
            ssm_dtype=self.ssm_dtype_name,
        )

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
        outputs = self._drain_inbox()
        chunks = self.scheduler.schedule()
        launched = self._launch(chunks) if chunks else None
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
        """Run the chunks' tokens and sample, without waiting for the device; the sampled ids become pending."""
        batch = StepBatch.from_chunks(chunks)
        logits = self.runner.execute(batch)
        requests = [self._requests[chunks[index].seq.request_id] for index in batch.sample_indices]
        tokens = self.sampler.sample(logits, [request.sampling for request in requests])
        if self.overlap_steps:
            self.runner.record_sampled(tokens)
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        for request in requests:
            request.seq.num_pending_tokens += 1
        ready = None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            tokens, ready = host, torch.cuda.Event()
            ready.record()
        return _LaunchedStep(requests, tokens, ready)

    def _resolve(self, launched: _LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's ids and apply them to the requests still live (in step order, so each fills the
        oldest pending token of its request)."""
        if launched.ready is not None:
            started = time.perf_counter()
            launched.ready.synchronize()
            self.device_wait_s += time.perf_counter() - started
            if self.executor is not None:
                self.executor.check_collectives()  # ids of a step whose collectives were aborted are not tokens
        live = [(request, token) for request, token in zip(launched.requests, launched.tokens.tolist())
                if not request.seq.finished]  # the others were aborted, or stopped by an earlier step's token
        return self._append_tokens([request for request, _ in live], [token for _, token in live])

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outputs = []
        for item in inbox:
            if isinstance(item, Sequence):
                self._requests[item.request_id] = _Request(
                    item, self.sampler.new_state(item.params), IncrementalDetokenizer(item.params.stop))
                self.scheduler.add(item)
            else:
                seq = self.scheduler.abort(item)
                if seq is not None:
                    request = self._requests[seq.request_id]
                    request.detokenizer.flush(self.tokenizer)
                    outputs.append(self._output(request, []))
                    self._forget(seq)
        return outputs

    def _append_tokens(self, requests: list[_Request], tokens: list[int]) -> list[RequestOutput]:
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
        for request, reason in zip(requests, reasons):
            seq = request.seq
            if seq.num_completion_tokens == 1:
                self.prompt_tokens_total += seq.num_prompt_tokens
            new_tokens = seq.token_ids[seq.num_prompt_tokens + request.emitted_tokens:]
            request.emitted_tokens = seq.num_completion_tokens
            if reason is not None:
                self._forget(seq)
                request.detokenizer.flush(self.tokenizer)
            outputs.append(self._output(request, new_tokens))
        return outputs

    def _output(self, request: _Request, new_tokens: list[int]) -> RequestOutput:
        seq = request.seq
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            text_delta=request.detokenizer.delta(seq.finished),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens,
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
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(request_ids):
            for output in self.step():
                if output.request_id in tokens:
                    tokens[output.request_id].extend(output.new_token_ids)
                    texts[output.request_id].append(output.text_delta)
                    if output.finished:
                        finals[output.request_id] = output
        return [
            Completion(request_id, ids, tokens[request_id], "".join(texts[request_id]),
                       finals[request_id].finish_reason, finals[request_id].prompt_tokens,
                       finals[request_id].completion_tokens)
            for request_id, ids in zip(request_ids, prompt_ids)
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
            predicted={
                "weights_bytes": prediction.weights_bytes,
                "reserve_bytes": prediction.reserve_bytes,
                "budget_bytes": prediction.budget_bytes,
                "token_blocks": predicted_layout.token_blocks,
                "token_capacity": predicted_layout.token_capacity,
                "state_slots": predicted_layout.state_slots,
                "token_pool_bytes": predicted_layout.token_pool_bytes,
                "state_pool_bytes": predicted_layout.state_pool_bytes,
            },
            usage={
                "used_token_blocks": self.cache.blocks.num_used_blocks,
                "used_state_slots": self.cache.slots.num_used_slots,
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
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
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
            "block_size": self.config.block_size,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "num_full_attention_layers": self.geometry.num_full_attention_layers,
            "num_linear_attention_layers": self.geometry.num_linear_attention_layers,
            "eos_token_ids": list(self.tokenizer.eos_token_ids),
            "cuda_graphs": bool(self.runner.graphs),
        }

    def check_invariants(self) -> None:
        """Raise PoolInvariantError unless the pools match what the live requests hold."""
        self.cache.check_invariants(self.scheduler.live_sequences())
        if self.executor is not None:
            self.executor.check_pools()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine cannot step afterwards."""
        if self.executor is not None:
            self.executor.shutdown()


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for but no CUDA GPU is visible; use --device cpu")
    return resolved
