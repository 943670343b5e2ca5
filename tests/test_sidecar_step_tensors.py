"""The runner's step tensors: every token's token-pool position and the packed host-to-device buffer, against the
per-token definitions (block `position // block_size` of the sequence's table, offset `position % block_size`)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hybridkv.sidecar.core.transfer import PinnedStaging  # noqa: E402
from hybridkv.sidecar.execution.runner import ModelRunner, StepBatch, _slot_mapping  # noqa: E402

BLOCK_SIZE = 16


@st.composite
def steps(draw):
    """A step of decodes then prefill chunks, each chunk ending at its context length and starting anywhere in a
    block (a chunk continuing a prompt, or after cached blocks)."""
    num_decodes = draw(st.integers(0, 6))
    num_prefills = draw(st.integers(0 if num_decodes else 1, 4))
    query_lens, seq_lens, tables = [], [], []
    next_block = 1
    for index in range(num_decodes + num_prefills):
        query_len = 1 if index < num_decodes else draw(st.integers(1, 90))
        seq_len = query_len + draw(st.integers(0, 70))
        blocks = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + blocks))[::-1])  # blocks in no particular order
        next_block += blocks
        query_lens.append(query_len)
        seq_lens.append(seq_len)
    return num_decodes, query_lens, seq_lens, tables


@settings(max_examples=60, deadline=None)
@given(steps())
def test_every_new_token_lands_at_its_blocks_offset(step):
    _, query_lens, seq_lens, tables = step
    want = [table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            for table, query_len, seq_len in zip(tables, query_lens, seq_lens)
            for position in range(seq_len - query_len, seq_len)]
    assert list(_slot_mapping(tables, query_lens, seq_lens, BLOCK_SIZE)) == want


@settings(max_examples=30, deadline=None)
@given(steps())
def test_the_packed_step_holds_each_part_as_the_batch_states_it(step):
    num_decodes, query_lens, seq_lens, tables = step
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    num_seqs = len(query_lens)
    batch = StepBatch(num_decodes=num_decodes, input_ids=[7 + p for p in positions], positions=positions,
                      query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                      state_slots=list(range(1, num_seqs + 1)), sample_indices=list(range(num_seqs)))
    cpu = torch.device("cpu")
    runner = types.SimpleNamespace(block_size=BLOCK_SIZE, device=cpu, _staging=PinnedStaging(cpu),
                                   last_tokens=torch.zeros(num_seqs + 1, dtype=torch.long))
    input_ids, positions_t, ctx, sample_slots = ModelRunner._prepare(runner, batch)
    assert input_ids.tolist() == batch.input_ids and positions_t.tolist() == positions
    assert ctx.slot_mapping.tolist() == list(_slot_mapping(tables, query_lens, seq_lens, BLOCK_SIZE))
    assert ctx.cu_seqlens_q.tolist() == ctx.cu_seqlens_q_cpu and ctx.cu_seqlens_q_cpu[-1] == len(positions)
    assert ctx.seq_lens.tolist() == seq_lens and ctx.state_slot_ids.tolist() == batch.state_slots
    width = max(len(table) for table in tables)
    assert ctx.block_tables.tolist() == [table + [0] * (width - len(table)) for table in tables]
    assert sample_slots.tolist() == batch.state_slots
    assert ctx.prefill_on_null_slot is False


def _decode_step(tables: list[list[int]], ids: list[int], first_slot: int) -> StepBatch:
    seq_lens = [len(table) * BLOCK_SIZE - index % BLOCK_SIZE for index, table in enumerate(tables)]
    num_seqs = len(tables)
    return StepBatch(num_decodes=num_seqs, input_ids=ids, positions=[n - 1 for n in seq_lens],
                     query_lens=[1] * num_seqs, seq_lens=seq_lens, block_tables=tables,
                     state_slots=list(range(first_slot, first_slot + num_seqs)), sample_indices=list(range(num_seqs)))


@pytest.mark.parametrize("kernel_mode", ["reference", "triton"])
def test_a_staged_decode_step_fills_the_graph_buffers_as_the_general_path_builds_them(monkeypatch, kernel_mode):
    """A replayed decode step's inputs (one packed copy, unpacked by the graph's first kernel) against `_prepare`'s
    tensors for the same step: every live row alike with the pending ids read from `last_tokens`, and the rows up to
    the graph's batch size padding, also where a wider step before left its rows behind."""
    if kernel_mode == "triton":
        pytest.importorskip("triton")
    # Triton compiles the kernel on a CUDA machine; elsewhere the interpreter runs it (conftest.py).
    device = torch.device("cuda" if kernel_mode == "triton" and torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("HYBRIDKV_KERNELS", kernel_mode)
    runner = types.SimpleNamespace(block_size=BLOCK_SIZE, device=device, graphs={4: None, 8: None},
                                   last_tokens=torch.arange(100, 120, device=device), _sample_slots=None,
                                   _staging=PinnedStaging(device))
    ModelRunner._init_decode_inputs(runner, max_batch=8, max_blocks_per_seq=6)
    wide = _decode_step([[9, 8, 7, 6, 5, 4]] * 7, [3] * 7, first_slot=1)
    step = _decode_step([[1, 2], [3], [4, 5, 6]], [-1, 42, -1], first_slot=11)
    inputs = runner._graph_inputs
    for batch, graph_size in ((wide, 8), (step, 4)):
        assert ModelRunner._stage_decode(runner, batch) == graph_size
        ModelRunner._unpack_decode_inputs(runner, graph_size)
    input_ids, positions, ctx, sample_slots = ModelRunner._prepare(runner, step)
    resolved = [runner.last_tokens[11].item(), 42, runner.last_tokens[13].item()]
    assert input_ids.tolist() == resolved == inputs["input_ids"][:3].tolist()
    assert inputs["positions"][:3].tolist() == positions.tolist()
    assert inputs["slot_mapping"][:3].tolist() == ctx.slot_mapping.tolist()
    assert inputs["seq_lens"][:3].tolist() == ctx.seq_lens.tolist()
    assert inputs["state_slot_ids"][:3].tolist() == ctx.state_slot_ids.tolist()
    assert inputs["block_tables"][:3, :3].tolist() == ctx.block_tables.tolist()
    assert runner._sample_slots.tolist() == sample_slots.tolist() == [11, 12, 13]
    # Row 3 pads the graph of four: what the wide step left there is gone where attention reads.
    assert inputs["input_ids"][3] == 0 and inputs["seq_lens"][3] == 1 and inputs["state_slot_ids"][3] == 0
    assert inputs["slot_mapping"][3] == 0 and inputs["block_tables"][3, :3].tolist() == [0, 0, 0]
