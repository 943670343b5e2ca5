"""Start-up warm-up: every kernel specialization serving can meet is compiled before the engine reports ready.

Triton compiles a kernel once per key: its constexpr values (our launch configurations pick tile sizes, split-KV
segments and pipeline depths from the step's shape), and, for integer and pointer arguments not marked
`do_not_specialize`, whether an integer is 1 or divisible by 16 and whether a pointer is 16-byte aligned. The kernels
mark every integer and pointer that varies with the batch as not specialized, so what is left to cover is the
launch configurations: `warmup_plan` enumerates, per kernel, every configuration reachable within the engine's
limits and one step shape that reaches it. fla's stages are autotuned on model constants only (heads, head sizes,
chunk size; `T` is not specialized), so any prefill covers them. Decode batches replayed as CUDA graphs are compiled
when they are captured.

`JitCompileCounter` counts compiles through Triton's post-compile hook (one hook for the process, telling every live
counter); after `mark_ready` a compile is a stall a user would see.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The prefill chunk length of warm-up steps that must not take the decode-shaped attention tiles.
_SHORT_PREFILL_TOKENS = 2


@dataclass(frozen=True)
class KernelShapes:
    """What the launch configurations read besides the step's shape: one rank's heads and the device's limits."""

    num_kv_heads: int
    attention_group: int
    head_dim: int
    kv_element_bytes: int
    block_size: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    state_element_bytes: int
    num_experts: int  # per rank; 0 for dense models
    experts_per_token: int
    multiprocessors: int
    shared_memory_bytes: int


@dataclass(frozen=True)
class WarmupStep:
    """`decodes` one-token rows at context `decode_context_tokens`, then `prefills` chunks of `prefill_tokens` tokens
    ending at context `prefill_context_tokens`."""

    decodes: int
    decode_context_tokens: int
    prefills: int
    prefill_tokens: int
    prefill_context_tokens: int

    @property
    def num_seqs(self) -> int:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return self.decodes + self.prefills * self.prefill_tokens

    @property
    def max_seqlen_q(self) -> int:
        return self.prefill_tokens if self.prefills else 1

    @property
    def decode_max_seqlen_k(self) -> int:
        return self.decode_context_tokens if self.decodes else 0

    @property
    def prefill_max_seqlen_k(self) -> int:
        return self.prefill_context_tokens if self.prefills else 0

    @property
    def max_seqlen_k(self) -> int:
        return max(self.decode_max_seqlen_k, self.prefill_max_seqlen_k)


def attention_launches(step) -> list[tuple[int, int, int]]:
    """(sequences, longest query, longest context) of each paged-attention launch of a step, as the model splits
    them (`BatchContext.attention_parts`): decode rows and prefill chunks apart when a step has both."""
    from hybridkv.sidecar.model.context import attention_apart

    if attention_apart(step.decodes, step.num_seqs):
        return [(step.decodes, 1, step.decode_max_seqlen_k),
                (step.prefills, step.max_seqlen_q, step.prefill_max_seqlen_k)]
    return [(step.num_seqs, step.max_seqlen_q, step.max_seqlen_k)]


def step_keys(step: WarmupStep, shapes: KernelShapes) -> set[tuple]:
    """The (kernel, launch configuration) pairs one eager step compiles."""
    from hybridkv.kernels.attention import attention_launch_config
    from hybridkv.kernels.fp8_gemm import fp8_gemm_config
    from hybridkv.kernels.gdn_recurrent import decode_launch_config
    from hybridkv.kernels.gdn_state import chunk_state_launch_config, folds_wy_form
    from hybridkv.kernels.moe import alignment_for, launch_for
    from hybridkv.kernels.triton_utils import L2_PREFETCH_MAX_ROWS
    from hybridkv.kernels.w4a16_gemm import w4a16_gemm_config

    tokens = step.num_tokens
    keys = {("fp8_gemm", tuple(sorted(fp8_gemm_config(tokens).items()))),
            ("w4a16_gemm", tuple(sorted(w4a16_gemm_config(tokens).items()))),
            # The layer norms launch with L2 prefetch programs up to this many rows (models with large projections).
            ("norm_prefetch", tokens <= L2_PREFETCH_MAX_ROWS)}
    for num_seqs, max_seqlen_q, max_seqlen_k in attention_launches(step):
        attention = attention_launch_config(
            num_seqs, shapes.num_kv_heads, shapes.attention_group, max_seqlen_q, max_seqlen_k, shapes.block_size,
            shapes.multiprocessors, shapes.head_dim, shapes.kv_element_bytes, shapes.shared_memory_bytes)
        keys.add(("paged_attention", tuple(sorted(attention.items()))))
    if shapes.num_experts:
        rows = tokens * shapes.experts_per_token
        launch = launch_for(rows, shapes.num_experts)
        keys.add(("fused_moe", launch, alignment_for(tokens, rows, launch)))
    if step.decodes:
        keys.add(("gdn_decode", decode_launch_config(step.decodes, shapes.num_v_heads, shapes.head_v_dim)))
    if step.prefills:
        folded = folds_wy_form(step.prefills, shapes.num_v_heads, shapes.head_v_dim, shapes.multiprocessors)
        state = None if folded else tuple(sorted(chunk_state_launch_config(
            step.prefills, shapes.num_v_heads, shapes.head_k_dim, shapes.head_v_dim, shapes.state_element_bytes,
            shapes.multiprocessors, shapes.shared_memory_bytes).items()))
        keys.add(("gdn_chunk_states", folded, state))
    return keys


def _context_lengths(low: int, max_model_len: int) -> list[int]:
    """Powers of two from `low` up, and the longest context: the split-KV thresholds are powers of two."""
    lengths, length = [], max(1, low)
    while length < max_model_len:
        lengths.append(length)
        length *= 2
    return lengths + [max_model_len]


def reachable_steps(shapes: KernelShapes, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                    graphs: bool):
    """Step shapes whose keys together are every key a served step can have: for each kernel, the dimensions its
    configuration reads swept over their whole range (pure decode steps only without CUDA graphs)."""
    # Attention: sequences x query length (decode-shaped up to 16 rows of heads, then any prefill) x context.
    decode_shaped_q = max(1, 16 // max(1, 1 << (shapes.attention_group - 1).bit_length()))
    query_lengths = sorted({1, *range(2, decode_shaped_q + 1), decode_shaped_q + 1})
    for num_seqs in range(1, max_num_seqs + 1):
        for query in query_lengths:
            if query == 1:
                if graphs:
                    continue
                if num_seqs > max_num_batched_tokens:
                    break
                for context in _context_lengths(1, max_model_len):
                    yield WarmupStep(num_seqs, context, 0, 0, 0)
                continue
            if num_seqs - 1 + query > max_num_batched_tokens or query > max_model_len:
                continue
            for context in _context_lengths(query, max_model_len):
                yield WarmupStep(num_seqs - 1, context, 1, query, context)
    # Decode rows of mixed steps (the GDN decode tiles), and prefill sequences (the state-pass configuration).
    for decodes in range(1, max_num_seqs):
        yield WarmupStep(decodes, 1, 1, _SHORT_PREFILL_TOKENS, _SHORT_PREFILL_TOKENS)
    for prefills in range(1, min(max_num_seqs, max_num_batched_tokens // _SHORT_PREFILL_TOKENS) + 1):
        yield WarmupStep(0, 0, prefills, _SHORT_PREFILL_TOKENS, _SHORT_PREFILL_TOKENS)
    # Token counts (the GEMM and MoE tiles): one prefill chunk of each length.
    for tokens in range(_SHORT_PREFILL_TOKENS, min(max_num_batched_tokens, max_model_len) + 1):
        yield WarmupStep(0, 0, 1, tokens, tokens)


def warmup_plan(shapes: KernelShapes, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                graphs: bool) -> list[WarmupStep]:
    """The fewest steps, greedily, whose keys cover every key of `reachable_steps`: each step is kept only if it
    brings a key no earlier step has."""
    plan, covered = [], set()
    for step in reachable_steps(shapes, max_num_seqs, max_num_batched_tokens, max_model_len, graphs):
        keys = step_keys(step, shapes)
        if not keys <= covered:
            plan.append(step)
            covered |= keys
    return plan


class _CompileHook:
    """The one post-compile hook this module installs in Triton: it tells every live counter, then calls the hook it
    found installed. Counters are held weakly, so an engine dropped without `close()` stops counting (and warning
    about) the compiles of the engines built after it in the same process."""

    def __init__(self):
        self.counters: weakref.WeakSet[JitCompileCounter] = weakref.WeakSet()
        self.previous = None

    def __call__(self, *args, **kwargs):
        for counter in list(self.counters):
            counter._on_compile(kwargs)
        return self.previous(*args, **kwargs) if self.previous is not None else None

    def add(self, counter: JitCompileCounter) -> None:
        import triton

        runtime = triton.knobs.runtime
        if runtime.jit_post_compile_hook is not self:
            self.previous = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = self
        self.counters.add(counter)

    def discard(self, counter: JitCompileCounter) -> None:
        """Without counters left, the hook found at the first `add` is put back (unless another has replaced ours)."""
        import triton

        self.counters.discard(counter)
        runtime = triton.knobs.runtime
        if not self.counters and runtime.jit_post_compile_hook is self:
            runtime.jit_post_compile_hook, self.previous = self.previous, None


_COMPILE_HOOK = _CompileHook()


class JitCompileCounter:
    """Counts Triton JIT compiles in this process through `triton.knobs.runtime.jit_post_compile_hook` (a hook
    installed before it is still called). After `mark_ready`, each compile is also logged as a warning."""

    def __init__(self):
        self._lock = threading.Lock()
        self.compiles_total = 0
        self.compiles_after_ready = 0
        self.ready = False
        self.installed = False

    def install(self) -> None:
        try:
            import triton  # noqa: F401
        except ImportError:  # CPU-only installs have no Triton: nothing can compile
            return
        _COMPILE_HOOK.add(self)
        self.installed = True

    def uninstall(self) -> None:
        """Stop counting (the engine's close): compiles after the engine closes, by other code in the same process,
        are not the engine's."""
        if not self.installed:
            return
        _COMPILE_HOOK.discard(self)
        self.installed = False

    def mark_ready(self) -> None:
        self.ready = True

    def _on_compile(self, kwargs: dict) -> None:
        with self._lock:
            self.compiles_total += 1
            if self.ready:
                self.compiles_after_ready += 1
        if self.ready:
            # The specialization key says which argument's value or alignment was new (bounded: keys of kernels
            # with many arguments run long).
            log.warning("Triton compiled %s after ready: a shape the warm-up did not cover (key %.600s)",
                        kwargs.get("repr"), kwargs.get("key"))


def warmup_batch(step: WarmupStep, block_size: int):
    """The step as a `StepBatch` on the null slot and the null block, as CUDA graph padding rows run: nothing a
    request holds is read or written."""
    from hybridkv.sidecar.core.cache import blocks_for_tokens
    from hybridkv.sidecar.execution.runner import StepBatch

    rows = [(1, step.decode_context_tokens)] * step.decodes
    rows += [(step.prefill_tokens, step.prefill_context_tokens)] * step.prefills
    return StepBatch(
        num_decodes=step.decodes,
        input_ids=[0] * step.num_tokens,
        positions=[p for query, context in rows for p in range(context - query, context)],
        query_lens=[query for query, _ in rows],
        seq_lens=[context for _, context in rows],
        block_tables=[[0] * blocks_for_tokens(context, block_size) for _, context in rows],
        state_slots=[0] * len(rows),
        sample_indices=list(range(len(rows))),
    )
