"""A decode step's inputs unpacked on the device, in one launch, into the fixed buffers a captured decode graph reads.

The host packs the step as one int64 buffer (`reference.pack_decode_inputs` says the layout) and copies it to the
device in one transfer; `unpack_decode_inputs` runs first inside the graph. It widens or narrows each field to its
buffer's dtype, fills in the ids the host has not read yet (negative: the last token sampled for the row's state
slot) and writes the padding rows past the step's own (token 0 at position 0, context 1 in the null block, the null
state slot). The row and table counts are read from the buffer, not passed as arguments, so one compiled kernel
serves every step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .reference import check_decode_inputs

_BLOCK_COLUMNS = 256


@triton.jit
def _unpack_decode_inputs_kernel(
    packed_ptr, last_tokens_ptr, input_ids_ptr, positions_ptr, slot_mapping_ptr, seq_lens_ptr, state_slots_ptr,
    sample_slots_ptr, block_tables_ptr, stride_bt_row, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    num_rows = tl.load(packed_ptr).to(tl.int32)
    width = tl.load(packed_ptr + 1).to(tl.int32)
    # This program's row as a one-element block, so its loads take a mask.
    rows = row + tl.arange(0, 1)
    live = rows < num_rows
    field = packed_ptr + 2 + rows
    token = tl.load(field, mask=live, other=0)
    position = tl.load(field + num_rows, mask=live, other=0)
    flat_slot = tl.load(field + 2 * num_rows, mask=live, other=0)
    seq_len = tl.load(field + 3 * num_rows, mask=live, other=1)
    state_slot = tl.load(field + 4 * num_rows, mask=live, other=0)
    pending = token < 0  # sampled on the device last step, not yet read by the host
    token = tl.where(pending, tl.load(last_tokens_ptr + state_slot, mask=pending, other=0).to(token.dtype), token)
    tl.store(input_ids_ptr + rows, token.to(input_ids_ptr.dtype.element_ty))
    tl.store(positions_ptr + rows, position.to(positions_ptr.dtype.element_ty))
    tl.store(slot_mapping_ptr + rows, flat_slot.to(slot_mapping_ptr.dtype.element_ty))
    tl.store(seq_lens_ptr + rows, seq_len.to(seq_lens_ptr.dtype.element_ty))
    tl.store(state_slots_ptr + rows, state_slot.to(state_slots_ptr.dtype.element_ty))
    tl.store(sample_slots_ptr + rows, state_slot.to(sample_slots_ptr.dtype.element_ty))
    tables = packed_ptr + 2 + 5 * num_rows + row.to(tl.int64) * width
    out_row = block_tables_ptr + row.to(tl.int64) * stride_bt_row
    # A padding row gets zeros (the null block) over the step's width; columns past it keep what they held, which
    # attention never reads (it reads a row's blocks up to its context length).
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_table = cols < width
        block = tl.load(tables + cols, mask=in_table & live, other=0)
        tl.store(out_row + cols, block.to(block_tables_ptr.dtype.element_ty), mask=in_table)


def unpack_decode_inputs(packed, last_tokens, input_ids, positions, slot_mapping, seq_lens, state_slots,
                         sample_slots, block_tables):
    """`packed` (int64, `pack_decode_inputs`' layout) -> every row of the fixed buffers (`input_ids.shape[0]` rows;
    `block_tables` `[rows, max_blocks]`), ids < 0 taken from `last_tokens[state slot]`; rows past the packed count
    are padding."""
    rows = check_decode_inputs(packed, last_tokens, input_ids, positions, slot_mapping, seq_lens, state_slots,
                               sample_slots, block_tables)
    if rows:
        _unpack_decode_inputs_kernel[(rows,)](
            packed, last_tokens, input_ids, positions, slot_mapping, seq_lens, state_slots, sample_slots,
            block_tables, block_tables.stride(0), BLOCK=_BLOCK_COLUMNS, num_warps=1,
        )
