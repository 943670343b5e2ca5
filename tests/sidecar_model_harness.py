"""Test helpers for the sidecar model: pools, batch contexts, and the Hugging Face reference on the same folder.

`PagedHarness` plays the engine runner's part in miniature: it allocates the token pool and the state pool (null
block 0 and null slot 0 included), hands out slots and blocks, and turns a list of (sequence, new tokens) into the
flat tensors of a `BatchContext`. Blocks are handed out in a shuffled order so block tables are not the identity.
"""

from __future__ import annotations

import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hybridkv.sidecar.model.context import BatchContext
from hybridkv.sidecar.model.loader import load_checkpoint
from hybridkv.sidecar.model.qwen3_5 import Qwen3_5ForCausalLM
from hybridkv.sizing import geometry_from_config


def load_model(folder, dtype=torch.float32, tp_rank: int = 0, tp_size: int = 1, device="cpu") -> Qwen3_5ForCausalLM:
    import json
    from pathlib import Path

    geometry = geometry_from_config(json.loads((Path(folder) / "config.json").read_text()))
    model = Qwen3_5ForCausalLM(geometry, dtype, device, tp_rank=tp_rank, tp_size=tp_size)
    load_checkpoint(model, folder)
    return model


@dataclass
class _Sequence:
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


class PagedHarness:
    def __init__(self, model: Qwen3_5ForCausalLM, max_seqs: int = 8, num_blocks: int = 64, block_size: int = 4,
                 seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.device = device = model.lm_head.weight.device
        kv_shape = model.kv_cache_shape(num_blocks + 1, block_size)
        conv_shape, ssm_shape = model.state_cache_shapes(max_seqs + 1)
        self.kv_caches = [(torch.zeros(kv_shape, dtype=model.dtype, device=device),
                           torch.zeros(kv_shape, dtype=model.dtype, device=device)) for _ in model.attention_layers]
        self.state_caches = [(torch.zeros(conv_shape, dtype=model.dtype, device=device),
                              torch.zeros(ssm_shape, dtype=torch.float32, device=device)) for _ in model.gdn_layers]
        self.free_blocks = list(range(1, num_blocks + 1))
        random.Random(seed).shuffle(self.free_blocks)
        self.free_slots = list(range(max_seqs, 0, -1))
        self.sequences: dict[str, _Sequence] = {}

    def _allocate_slot(self) -> int:
        slot = self.free_slots.pop()
        for conv_state, ssm_state in self.state_caches:
            conv_state[slot].zero_()
            ssm_state[slot].zero_()
        return slot

    def add_padding_row(self, seq_id: str) -> None:
        """A sequence on the null slot and null block, as CUDA-graph padding rows are; step it with one token."""
        self.sequences[seq_id] = _Sequence(slot=0, blocks=[0], num_cached_tokens=1)

    def release(self, seq_id: str) -> None:
        sequence = self.sequences.pop(seq_id)
        self.free_slots.append(sequence.slot)
        self.free_blocks.extend(sequence.blocks)

    def build(self, batch: list[tuple[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, BatchContext]:
        """(input_ids, positions, ctx) of one step, allocating slots and blocks; decodes (1 new token of a sequence
        with cached tokens) must come first."""
        input_ids, positions, slot_mapping, cu_seqlens, seq_lens, slots, tables = [], [], [], [0], [], [], []
        num_decodes = 0
        for index, (seq_id, tokens) in enumerate(batch):
            sequence = self.sequences.get(seq_id) or self.sequences.setdefault(seq_id, _Sequence(self._allocate_slot()))
            if len(tokens) == 1 and sequence.num_cached_tokens > 0:
                assert num_decodes == index, "decodes must come first in a batch"
                num_decodes += 1
            start = sequence.num_cached_tokens
            end = start + len(tokens)
            while len(sequence.blocks) * self.block_size < end:
                sequence.blocks.append(self.free_blocks.pop())
            for position in range(start, end):
                block = sequence.blocks[position // self.block_size]
                slot_mapping.append(block * self.block_size + position % self.block_size)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            cu_seqlens.append(cu_seqlens[-1] + len(tokens))
            seq_lens.append(end)
            slots.append(sequence.slot)
            tables.append(sequence.blocks)
            sequence.num_cached_tokens = end
        max_blocks = max(len(table) for table in tables)
        block_tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)

        def on_device(values, dtype):
            return torch.as_tensor(values, dtype=dtype).to(self.device)

        ctx = BatchContext(
            num_decodes=num_decodes,
            cu_seqlens_q=on_device(cu_seqlens, torch.int32),
            cu_seqlens_q_cpu=cu_seqlens,
            seq_lens=on_device(seq_lens, torch.int32),
            block_tables=block_tables.to(self.device),
            slot_mapping=on_device(slot_mapping, torch.int64),
            state_slot_ids=on_device(slots, torch.int32),
            max_seqlen_q=max(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])),
            max_seqlen_k=max(seq_lens),
        )
        # Several harnesses may share one model: bind this one's pools for the step.
        self.model.bind_caches(self.kv_caches, self.state_caches)
        return on_device(input_ids, torch.int64), on_device(positions, torch.int64), ctx

    @torch.no_grad()
    def step(self, batch: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run one step; returns fp32 logits of every new token, [T, vocab], on the host."""
        input_ids, positions, ctx = self.build(batch)
        return self.model.compute_logits(self.model(input_ids, positions, ctx)).cpu()


# transformers' modeling module and causal-LM class of each model type the engine serves.
HF_MODEL_CLASSES = {
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM"),
}


def _closure_of(function) -> dict:
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())}


def _decorated_function(decorated):
    """The function behind a name transformers' hub-kernel decorators made: with the `kernels` package installed it is
    a module whose forward calls the function."""
    if isinstance(decorated, torch.nn.Module):
        return _closure_of(type(decorated).forward)["func"]
    return decorated


@contextmanager
def transformers_without_fla(model_type: str = "qwen3_5_text"):
    """Import transformers' model with flash-linear-attention hidden, so its plain-torch GDN path is the oracle.

    transformers picks fla or torch when the modeling module is first imported; the original `fla` entry of
    sys.modules is restored afterwards so other tests can still import fla.
    """
    had_fla, saved = "fla" in sys.modules, sys.modules.get("fla")
    sys.modules["fla"] = None
    try:
        import importlib

        package, class_name = HF_MODEL_CLASSES[model_type]
        modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        wrapped = _decorated_function(modeling.torch_chunk_gated_delta_rule)
        implementation = _closure_of(wrapped).get("implementation")
        if implementation is not None and implementation is not wrapped.__wrapped__:
            raise RuntimeError(f"transformers' {package} was imported with fla before this test; run it in its own "
                               "process")
        yield getattr(modeling, class_name)
    finally:
        if had_fla:
            sys.modules["fla"] = saved
        else:
            sys.modules.pop("fla", None)


# The engine's float32 dots run in TF32; against transformers in exact float32 its error is a TF32 rounding of the
# same sums as transformers' own TF32 spread, an independent draw of about the same size (measured on the 4B
# geometry: 0.215 against a spread of 0.269, 0.28 against 0.264). Either can be the larger, so the bound is this many
# spreads, not one.
TF32_SPREADS = 2


def tf32_spread(logits_of) -> tuple[torch.Tensor, float]:
    """`logits_of()` with TF32 matmuls off, and the largest change turning them on makes to it: how far TF32 alone
    moves transformers' logits; `TF32_SPREADS` of it bound kernels whose float32 dots run in TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    exact = logits_of()
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        tf32 = logits_of()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    return exact, (tf32 - exact).abs().max().item()


class HfReference:
    """transformers' model of the folder's model type: full-prompt logits and step-by-step cached decode."""

    def __init__(self, folder, dtype=torch.float32, device="cpu"):
        import json
        from pathlib import Path

        model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
        with transformers_without_fla(model_type) as model_class:
            self.model, info = model_class.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
        problems = {key: value for key, value in info.items() if value}
        assert not problems, f"transformers did not load the checkpoint cleanly: {problems}"
        self.device = torch.device(device)
        self.model.to(self.device).eval()

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], device=self.device)

    @torch.no_grad()
    def prompt_logits(self, tokens: list[int]) -> torch.Tensor:
        return self.model(self._ids(tokens)).logits[0].float().cpu()

    @torch.no_grad()
    def greedy(self, prompt: list[int], num_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation with the cache, one token per forward: (new tokens, logits that chose each)."""
        output = self.model(self._ids(prompt), use_cache=True)
        logits = [output.logits[0, -1].float().cpu()]
        tokens = [int(logits[-1].argmax())]
        for _ in range(num_new_tokens - 1):
            # transformers 5.24 renamed past_key_values to cache; older releases (on the GPU image) use the old name.
            keyword = "cache" if hasattr(output, "cache") else "past_key_values"
            output = self.model(self._ids([tokens[-1]]), use_cache=True, **{keyword: getattr(output, keyword)})
            logits.append(output.logits[0, -1].float().cpu())
            tokens.append(int(logits[-1].argmax()))
        return tokens, logits
