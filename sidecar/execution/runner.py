"""The model runner: loads the model, measures memory, and turns one scheduled step into flat tensors and logits.

`execute(batch)` is a function of a `StepBatch`, a picklable description made of plain ints, so every tensor-parallel
rank could run the same step; sampling and scheduling stay with the caller.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridkv import kernels
from hybridkv.kernels import reference as kernels_reference
from hybridkv.sidecar.core.cache import CacheManager, blocks_for_tokens
from hybridkv.sidecar.core.config import ConfigError
from hybridkv.sizing import PoolShapes
from hybridkv.sizing.prediction import piecewise_graph_tokens
from hybridkv.sizing.prefix import PREFILL_CHUNK_TOKENS
from hybridkv.sidecar.model.context import BatchContext, StateCaptures
from hybridkv.sidecar.core.sampler import Sampler
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.core.sequence import ScheduledChunk
from hybridkv.sidecar.core.transfer import PinnedStaging, to_device
from hybridkv.sidecar.execution.piecewise import PiecewiseGraphs, token_buckets

# Decode batch sizes captured as CUDA graphs: small sizes one by one, then every 16 (padding wastes at most 15 rows).
SMALL_GRAPH_BATCH_SIZES = (1, 2, 4, 8)
GRAPH_BATCH_STEP = 16
# The input id of a token sampled on the device that the host has not read yet; the runner fills it in on the device.
PENDING_TOKEN = -1


@dataclass(frozen=True)
class StepBatch:
    """One step, back to back: sequence i runs `query_lens[i]` tokens ending at context length `seq_lens[i]`.
    Input ids may be PENDING_TOKEN only in decode rows (see `ModelRunner.record_sampled`)."""

    num_decodes: int
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[array | list[int]]  # int64 arrays from the scheduler; lists where tests and warm-up build one
    state_slots: list[int]
    sample_indices: list[int]  # sequences whose last token's logits are returned, in this order
    # State slots assigned this step: every rank zeroes them before the step runs, so all ranks start them alike.
    fresh_slots: list[int] = field(default_factory=list)
    # Prefix caching, done by every rank: (checkpoint slot, state slot) copies before the step, so a request resumes
    # from a cached prefix; (state slot, checkpoint slot) copies after it, checkpointing a block boundary.
    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    # (sequence index, tokens into its chunk, checkpoint slot): checkpoints inside a prefill chunk, taken while it runs
    # (`StateCaptures`); the token count is a positive multiple of the GDN prefill's chunk length.
    captures: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def from_chunks(cls, chunks: list[ScheduledChunk]) -> "StepBatch":
        input_ids, positions, query_lens, seq_lens, block_tables, state_slots, sample_indices = ([] for _ in range(7))
        for index, chunk in enumerate(chunks):
            seq = chunk.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_tokens
            known = seq.token_ids[start:end]
            input_ids.extend(known)
            if len(known) < chunk.num_tokens:
                input_ids.extend([PENDING_TOKEN] * (chunk.num_tokens - len(known)))
            positions.extend(range(start, end))
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            block_tables.append(array("q", seq.block_table))  # a snapshot, copied as one block of memory
            state_slots.append(seq.state_slot)
            if chunk.samples:
                sample_indices.append(index)
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        fresh_slots = [chunk.seq.state_slot for chunk in chunks if chunk.fresh_slot]
        restores = [chunk.restore for chunk in chunks if chunk.restore]
        saves = [chunk.save for chunk in chunks if chunk.save]
        captures = [(index, tokens, slot) for index, chunk in enumerate(chunks) for tokens, slot in chunk.captures]
        return cls(num_decodes, input_ids, positions, query_lens, seq_lens, block_tables, state_slots, sample_indices,
                   fresh_slots, restores, saves, captures)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass(frozen=True)
class MemoryMeasurement:
    """Per rank. budget = total x utilization - weights - reserve, or the fixed budget when one was given."""

    total_memory_bytes: int
    weights_bytes: int
    reserve_bytes: int  # measured: activation peak of the profiling pass + CUDA graphs + memory outside the allocator
    budget_bytes: int
    activation_peak_bytes: int
    graph_bytes: int
    measured: bool  # False on CPU, where there is no device memory to measure


class ModelRunner:
    def __init__(self, config, geometry, device: torch.device, dtype: torch.dtype, tp_rank: int = 0):
        from hybridkv.sidecar.model.loader import load_checkpoint
        from hybridkv.sidecar.model.qwen3_5 import Qwen3_5ForCausalLM
        from hybridkv.sidecar.random_weights import fill_engine_model

        self.config = config
        self.geometry = geometry
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.model = Qwen3_5ForCausalLM(geometry, dtype, device, tp_rank, config.tensor_parallel_size)
        if config.load_format == "random":  # every rank builds its own shard of the same seeded weights
            fill_engine_model(self.model, config.read_model_config(), config.seed)
            if device.type == "cuda":
                # The float32 draws (the embedding's alone is GBs) leave cached segments; returned now, before the
                # sampler's and the step's buffers are carved out of them and pin them through memory profiling.
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
        else:
            load_checkpoint(self.model, config.model)
        self.model.eval()
        self.weights_bytes = sum(t.numel() * t.element_size() for t in self.model.parameters())
        self.cache: CacheManager | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Mixed and prefill steps of up to `piecewise.max_tokens` tokens replay their token-wise pieces as graphs.
        self.piecewise: PiecewiseGraphs | None = None
        self.graph_memory_bytes = 0
        self.graph_capture_s = 0.0
        self.max_blocks_per_seq = 0
        self.last_tokens: torch.Tensor | None = None  # [state slots + 1] the last token sampled for each slot
        self._sample_slots: torch.Tensor | None = None
        self._graph_inputs: dict[str, torch.Tensor] = {}
        self._decode_packed: torch.Tensor | None = None  # a replayed decode step's inputs, packed (`_stage_decode`)
        self._staging = PinnedStaging(device)  # every step's packed inputs go to the device through it

    # --- memory ---
    def measure_memory(self, shapes: PoolShapes, max_model_len: int, sampler: Sampler) -> MemoryMeasurement:
        """On CUDA: run a profiling step at max_num_batched_tokens (plus sampling over max_num_seqs rows) twice,
        measuring the second, and derive the cache budget from what is free afterwards. On CPU nothing is measured;
        the budget is the fixed one."""
        config = self.config
        if self.device.type != "cuda":
            _check_budget_fits(config.kv_cache_memory_bytes, host_available_bytes(), "host memory available")
            return MemoryMeasurement(0, self.weights_bytes, 0, config.kv_cache_memory_bytes, 0, 0, False)
        seq_len = min(max_model_len, config.max_num_batched_tokens)
        # The largest step the scheduler can form: the token budget, unless max_num_seqs full-length requests are less.
        num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * seq_len)
        num_seqs = blocks_for_tokens(num_tokens, seq_len)
        query_lens = [seq_len] * num_seqs
        query_lens[-1] = num_tokens - seq_len * (num_seqs - 1)
        blocks_per_seq = blocks_for_tokens(seq_len, self.block_size)
        scratch = CacheManager(num_seqs * blocks_per_seq, num_seqs, self.block_size, shapes, self.device)
        self.model.bind_caches(scratch.kv_caches, scratch.state_caches)
        self._bind_last_tokens(num_seqs)  # the decode graphs captured below read it; `bind` replaces it
        block_tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
        batch = StepBatch(
            num_decodes=0,
            input_ids=[0] * num_tokens,
            positions=[p for q in query_lens for p in range(q)],
            query_lens=query_lens,
            seq_lens=query_lens,
            block_tables=block_tables,
            state_slots=list(range(1, num_seqs + 1)),
            sample_indices=list(range(num_seqs)),
        )

        @torch.inference_mode()
        def profile_step() -> None:
            input_ids, positions, ctx, _ = self._prepare(batch, block_table_width=blocks_per_seq)
            hidden = self.model(input_ids, positions, ctx)
            # The sampler's worst case: every running request's row, all of them sorted for top-k/top-p.
            # (max_num_batched_tokens >= max_num_seqs is checked at start-up, so there are enough rows.)
            logits = self.model.compute_logits(hidden[: config.max_num_seqs])
            sampler(logits, [sampler.new_state(SamplingParams(temperature=1.0, top_p=0.9))] * config.max_num_seqs)

        # Once unmeasured: the first step at this size compiles, and autotunes fla's kernels unless their results
        # are cached on disk from an earlier process; Triton's benchmarking holds a 256 MB buffer to clear the L2
        # meanwhile. Measured only, that would make the peak (and so the capacity) depend on the cache's state.
        profile_step()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        profile_step()
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - baseline
        graph_bytes = 0
        if not config.enforce_eager:
            # The largest piecewise bucket and the largest decode graph set the size of the shared graph pool (and
            # the pieces' arenas); capture them once (decode rows all padding, so the scratch pools' null slot and
            # block suffice) to measure them, then drop them.
            torch.cuda.empty_cache()
            free_before, _ = torch.cuda.mem_get_info(self.device)
            self._capture_all(max_model_len, [config.max_num_seqs], self._piece_buckets()[-1:])
            torch.cuda.synchronize(self.device)
            graph_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
            self._release_graphs()
        # Unbind the scratch pools (null-only pools take their place) so their memory is really free.
        null_pools = CacheManager(0, 0, self.block_size, shapes, self.device)
        self.model.bind_caches(null_pools.kv_caches, null_pools.state_caches)
        del scratch
        torch.cuda.empty_cache()
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        # Weights, the CUDA context, allocator slack and anything else resident now, plus activations and graphs.
        reserve = (total_bytes - free_bytes) - self.weights_bytes + activation_peak + graph_bytes
        if config.kv_cache_memory_bytes is not None:
            _check_budget_fits(config.kv_cache_memory_bytes, free_bytes, f"GPU memory free after loading the weights")
            budget = config.kv_cache_memory_bytes
        else:
            budget = int(total_bytes * config.gpu_memory_utilization) - self.weights_bytes - reserve
        return MemoryMeasurement(total_bytes, self.weights_bytes, reserve, budget, activation_peak, graph_bytes, True)

    # --- pools ---
    def bind(self, cache: CacheManager, max_model_len: int) -> None:
        self.cache = cache
        self.max_blocks_per_seq = blocks_for_tokens(max_model_len, self.block_size)
        self.model.bind_caches(cache.kv_caches, cache.state_caches, cache.checkpoint_caches)
        self._bind_last_tokens(cache.slots.state_slots)
        if self.device.type == "cuda" and not self.config.enforce_eager:
            free_before, _ = torch.cuda.mem_get_info(self.device)
            self._capture_all(max_model_len, self._graph_batch_sizes(), self._piece_buckets())
            self.graph_memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]

    def _bind_last_tokens(self, state_slots: int) -> None:
        """The last token sampled for each state slot (the null slot 0 included); a captured decode graph reads it
        to fill in the ids the host has not read yet."""
        self.last_tokens = torch.zeros(state_slots + 1, dtype=torch.long, device=self.device)

    # --- one step ---
    @torch.inference_mode()
    def execute(self, batch: StepBatch, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits [len(batch.sample_indices), vocab]. `between_layers` is called
        after each layer's token mixer when the model runs the step layer by layer (`BatchContext`)."""
        if batch.fresh_slots:
            self.cache.zero_slots(batch.fresh_slots)
        if batch.restores:
            self.cache.restore_checkpoints(batch.restores)
        if self._replays_decode_graph(batch):
            hidden = self._replay(batch, self._stage_decode(batch))
            last_rows = batch.sample_indices  # one token per sequence
        else:
            input_ids, positions, ctx, self._sample_slots = self._prepare(batch)
            ctx.between_layers = between_layers
            if self.runs_piecewise(batch):
                hidden = self.piecewise.run(input_ids, positions, ctx)
            else:
                hidden = self.model(input_ids, positions, ctx)
            ends = _cumsum(batch.query_lens)[1:]
            last_rows = [ends[i] - 1 for i in batch.sample_indices]
        if batch.saves:
            self.cache.save_checkpoints(batch.saves)
        if last_rows == list(range(len(last_rows))):  # a pure decode step: no gather needed
            return self.model.compute_logits(hidden[: len(last_rows)])
        return self.model.compute_logits(hidden.index_select(0, to_device(last_rows, torch.long, self.device)))

    def _replays_decode_graph(self, batch: StepBatch) -> bool:
        return batch.num_decodes == batch.num_seqs and bool(self.graphs) and batch.num_seqs <= max(self.graphs)

    def runs_piecewise(self, batch: StepBatch) -> bool:
        """Whether `execute` runs `batch` through the piecewise graphs (replayed pieces, mixers launched between)."""
        return (not self._replays_decode_graph(batch) and self.piecewise is not None
                and len(batch.input_ids) <= self.piecewise.max_tokens)

    def record_sampled(self, tokens: torch.Tensor) -> None:
        """Keep the ids sampled from the last `execute`'s logits ([rows] on the device), by state slot: the next
        step's decode rows whose ids the host has not read yet (PENDING_TOKEN) read them here, without a sync."""
        self.last_tokens.index_copy_(0, self._sample_slots, tokens)

    def _prepare(self, batch: StepBatch, block_table_width: int | None = None):
        """Flat step tensors on the device, sent in one host-to-device copy; pending ids filled in on the device.
        Returns input ids, positions, the batch context and the state slots of the sampled rows."""
        cu_seqlens = _cumsum(batch.query_lens)
        width = block_table_width or max((len(t) for t in batch.block_tables), default=1) or 1
        # Packed in one int64 buffer part by part (C-level extends: a step of 256 long-context requests has tens of
        # thousands of block-table entries, which a per-value Python loop took milliseconds to copy).
        packed, sizes = array("q"), []

        def add(part) -> None:
            before = len(packed)
            packed.extend(part)
            sizes.append(len(packed) - before)

        for part in (batch.input_ids, batch.positions,
                     _slot_mapping(batch.block_tables, batch.query_lens, batch.seq_lens, self.block_size),
                     cu_seqlens, batch.seq_lens, batch.state_slots):
            add(part)
        before = len(packed)
        kernels_reference.extend_padded_tables(packed, batch.block_tables, width)
        sizes.append(len(packed) - before)
        add([batch.state_slots[i] for i in batch.sample_indices])
        if batch.captures:
            for part in self._capture_parts(batch, cu_seqlens):
                add(part)
        tensor = self._staging.to_device(packed)
        input_ids, positions, slot_mapping_t, cu_seqlens_t, seq_lens, state_slots, block_tables, sample_slots, \
            *capture_parts = tensor.split(sizes)
        num_decodes = batch.num_decodes
        if num_decodes and min(batch.input_ids[:num_decodes]) < 0:
            decode_ids = input_ids[:num_decodes]
            decode_ids.copy_(torch.where(decode_ids < 0, self.last_tokens[state_slots[:num_decodes]], decode_ids))
        ctx = BatchContext(
            num_decodes=batch.num_decodes,
            cu_seqlens_q=cu_seqlens_t.to(torch.int32),
            cu_seqlens_q_cpu=cu_seqlens,
            seq_lens=seq_lens.to(torch.int32),
            block_tables=block_tables.to(torch.int32).view(batch.num_seqs, width),
            slot_mapping=slot_mapping_t,
            state_slot_ids=state_slots.to(torch.int32),
            max_seqlen_q=max(batch.query_lens),
            max_seqlen_k=max(batch.seq_lens),
            decode_max_seqlen_k=max(batch.seq_lens[:num_decodes], default=None),
            prefill_max_seqlen_k=max(batch.seq_lens[num_decodes:], default=None),
            state_captures=self._state_captures(*capture_parts) if capture_parts else None,
            prefill_on_null_slot=0 in batch.state_slots[batch.num_decodes:],
        )
        return input_ids, positions, ctx, sample_slots

    def _capture_parts(self, batch: StepBatch, cu_seqlens: list[int]) -> list[list[int]]:
        """`StateCaptures`' three tensors as host lists: a checkpoint slot per 64-token chunk of the prefill
        sequences (-1 for none), the conv-state rows before each capture point, and each capture's slot."""
        history = self.geometry.linear_conv_kernel_dim - 1
        first_prefill_row = cu_seqlens[batch.num_decodes]
        first_chunk, chunk_of_seq = 0, {}
        for index in range(batch.num_decodes, batch.num_seqs):
            chunk_of_seq[index] = first_chunk
            first_chunk += -(-batch.query_lens[index] // PREFILL_CHUNK_TOKENS)
        chunk_slots, conv_rows, conv_slots = [-1] * first_chunk, [], []
        for index, tokens, slot in batch.captures:
            if index < batch.num_decodes or tokens % PREFILL_CHUNK_TOKENS or not 0 < tokens < batch.query_lens[index]:
                raise ValueError(f"a capture {tokens} tokens into sequence {index}'s chunk of "
                                 f"{batch.query_lens[index]} is not at one of its chunk starts")
            chunk_slots[chunk_of_seq[index] + tokens // PREFILL_CHUNK_TOKENS] = slot
            end = cu_seqlens[index] + tokens - first_prefill_row
            conv_rows.extend(range(end - history, end))
            conv_slots.append(slot)
        return [chunk_slots, conv_rows, conv_slots]

    @staticmethod
    def _state_captures(chunk_slots: torch.Tensor, conv_rows: torch.Tensor, conv_slots: torch.Tensor):
        return StateCaptures(chunk_slots.to(torch.int32), conv_rows.view(conv_slots.shape[0], -1), conv_slots)

    # --- CUDA graphs: decode steps whole, mixed and prefill steps piecewise ---
    def _piece_buckets(self) -> list[int]:
        # The planner's rule (its reserve counts the same largest bucket).
        limit = piecewise_graph_tokens(self.config.max_num_batched_tokens, self.config.piecewise_cuda_graph_max_tokens)
        return token_buckets(limit) if limit else []

    def _capture_all(self, max_model_len: int, batch_sizes: list[int], piece_buckets: list[int]) -> None:
        """The piecewise graphs first (their intermediates are the pool's largest), then the decode graphs, all in one
        graph memory pool: graphs replay one at a time and hand nothing on through the pool."""
        started = time.monotonic()
        self._graph_pool = torch.cuda.graph_pool_handle()
        if piece_buckets:
            self.piecewise = PiecewiseGraphs(self.model.model, piece_buckets, self.device, self._graph_pool)
            self.piecewise.capture()
        self._capture_graphs(max_model_len, batch_sizes)
        self.graph_capture_s = time.monotonic() - started

    def _graph_batch_sizes(self) -> list[int]:
        limit = self.config.max_num_seqs
        sizes = [s for s in SMALL_GRAPH_BATCH_SIZES if s < limit]
        sizes += list(range(GRAPH_BATCH_STEP, limit, GRAPH_BATCH_STEP)) + [limit]
        return sorted(set(sizes))

    def _capture_graphs(self, max_model_len: int, batch_sizes: list[int]) -> None:
        """Capture decode steps for each batch size; padding rows use the null slot 0 and the null block 0, so no
        capture ever needs a state slot or token block beyond what the pools hold."""
        self.max_blocks_per_seq = blocks_for_tokens(max_model_len, self.block_size)
        max_batch = max(batch_sizes)
        device = self.device
        self._init_decode_inputs(max_batch, self.max_blocks_per_seq)
        self._graph_outputs: dict[int, torch.Tensor] = {}
        pool = self._graph_pool
        for batch_size in sorted(batch_sizes, reverse=True):
            ctx = self._graph_context(batch_size, max_model_len)
            inputs = self._graph_inputs
            with torch.inference_mode():
                # Warm-up outside capture: Triton compiles and autotunes here, not inside the graph.
                self._unpack_decode_inputs(batch_size)
                self.model(inputs["input_ids"][:batch_size], inputs["positions"][:batch_size], ctx)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._unpack_decode_inputs(batch_size)
                    output = self.model(inputs["input_ids"][:batch_size], inputs["positions"][:batch_size], ctx)
            self.graphs[batch_size] = graph
            self._graph_outputs[batch_size] = output
        torch.cuda.synchronize(device)

    def _release_graphs(self) -> None:
        self.graphs = {}
        self.piecewise = None
        self._graph_pool = None
        self._graph_outputs = {}
        self._graph_inputs = {}
        self._decode_packed = None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _graph_context(self, batch_size: int, max_model_len: int) -> BatchContext:
        inputs = self._graph_inputs
        return BatchContext(
            num_decodes=batch_size,
            cu_seqlens_q=inputs["cu_seqlens_q"][: batch_size + 1],
            cu_seqlens_q_cpu=list(range(batch_size + 1)),
            seq_lens=inputs["seq_lens"][:batch_size],
            block_tables=inputs["block_tables"][:batch_size],
            slot_mapping=inputs["slot_mapping"][:batch_size],
            state_slot_ids=inputs["state_slot_ids"][:batch_size],
            max_seqlen_q=1,
            max_seqlen_k=max_model_len,
        )

    # A replayed decode step's inputs: the host packs the step into one int64 buffer (`kernels.reference.
    # pack_decode_inputs`), copies it to the device in one transfer, and the graph's first kernel unpacks it into
    # the fixed buffers the rest of the graph reads (`kernels.unpack_decode_inputs`: dtypes, pending ids, padding
    # rows). Outside the graph a decode step then launches one copy, not a conversion, fill or copy per field.
    def _init_decode_inputs(self, max_batch: int, max_blocks_per_seq: int) -> None:
        device = self.device
        self._graph_inputs = {
            "input_ids": torch.zeros(max_batch, dtype=torch.long, device=device),
            "positions": torch.zeros(max_batch, dtype=torch.long, device=device),
            "seq_lens": torch.ones(max_batch, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device),
            "slot_mapping": torch.zeros(max_batch, dtype=torch.int64, device=device),
            "state_slot_ids": torch.zeros(max_batch, dtype=torch.int32, device=device),
            "sample_slots": torch.zeros(max_batch, dtype=torch.int64, device=device),
            "cu_seqlens_q": torch.arange(max_batch + 1, dtype=torch.int32, device=device),
        }
        # [n, width, five fields of n, n tables of width]; zeros (no rows) until a step is staged.
        self._decode_packed = torch.zeros(2 + 5 * max_batch + max_batch * max_blocks_per_seq, dtype=torch.long,
                                          device=device)

    def _unpack_decode_inputs(self, batch_size: int) -> None:
        inputs = self._graph_inputs
        rows = slice(0, batch_size)
        kernels.unpack_decode_inputs(
            self._decode_packed, self.last_tokens, inputs["input_ids"][rows], inputs["positions"][rows],
            inputs["slot_mapping"][rows], inputs["seq_lens"][rows], inputs["state_slot_ids"][rows],
            inputs["sample_slots"][rows], inputs["block_tables"][rows])

    def _stage_decode(self, batch: StepBatch) -> int:
        """Copy a pure decode step's packed inputs to the device; returns the graph batch size that runs it. The
        sampled rows' state slots (`record_sampled`) are the graph's own unpacked copy."""
        batch_size = min(size for size in self.graphs if size >= batch.num_seqs)
        packed = kernels_reference.pack_decode_inputs(
            batch.input_ids, batch.positions,
            _slot_mapping(batch.block_tables, batch.query_lens, batch.seq_lens, self.block_size),
            batch.seq_lens, batch.state_slots, batch.block_tables)
        self._staging.copy_into(packed, self._decode_packed[: len(packed)])
        slots = self._graph_inputs["sample_slots"]
        if batch.sample_indices == list(range(batch.num_seqs)):
            self._sample_slots = slots[: batch.num_seqs]
        else:
            self._sample_slots = slots.index_select(0, to_device(batch.sample_indices, torch.long, self.device))
        return batch_size

    def _replay(self, batch: StepBatch, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return self._graph_outputs[batch_size][: batch.num_seqs]


def _slot_mapping(block_tables: list, query_lens: list[int], seq_lens: list[int],
                  block_size: int) -> array:
    """The token-pool position (block * block_size + offset) of every new token of a step, sequence by sequence."""
    out = array("q")
    for table, query_len, end in zip(block_tables, query_lens, seq_lens):
        start = end - query_len
        if query_len == 1:
            out.append(table[start // block_size] * block_size + start % block_size)
            continue
        first, last = start // block_size, (end - 1) // block_size
        positions = [block * block_size + offset for block in table[first : last + 1] for offset in range(block_size)]
        out.extend(positions[start - first * block_size : end - first * block_size])
    return out


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return out


def host_available_bytes() -> int:
    """Memory the kernel says a new allocation can get without swapping (MemAvailable), else all physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_budget_fits(budget_bytes: int, available_bytes: int, what: str) -> None:
    """A fixed cache budget larger than the device can hold fails at start-up, not by exhausting the machine."""
    if budget_bytes > available_bytes:
        raise ConfigError(
            f"--kv-cache-memory {budget_bytes / 2**30:.2f} GiB exceeds the {available_bytes / 2**30:.2f} GiB of "
            f"{what}; lower it"
        )
