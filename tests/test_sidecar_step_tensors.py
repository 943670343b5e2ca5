"""The runner's step tensors: every token's token-pool position and the packed host-to-device buffer, against the
per-token definitions (block `position // block_size` of the sequence's table, offset `position % block_size`)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

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
    runner = types.SimpleNamespace(block_size=BLOCK_SIZE, device=torch.device("cpu"),
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
