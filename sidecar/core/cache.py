"""The dual-pool cache: a paged token pool for attention KV and a slot pool for GDN state.

Token pool: `token_blocks` usable blocks of `block_size` tokens plus the null block 0 (padding rows of a batch write
there; no request ever holds it). State pool: `state_slots` (= max_num_seqs) usable slots plus the null slot 0. The
engine sizes them with `hybridkv.sizing.dual_pool_layout`; the tensors allocated here are exactly the bytes it reports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybridkv.sidecar.core.sequence import Sequence
from hybridkv.sizing import PoolShapes

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class PoolInvariantError(RuntimeError):
    """The pools' bookkeeping is inconsistent (a leak, a double free or a block held twice): an engine bug."""


class PoolExhaustedError(RuntimeError):
    """An allocation was attempted without checking that the pool can serve it: an engine bug."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class TokenBlockPool:
    """Free list of usable token blocks 1..token_blocks; block 0 is the null block and is never handed out."""

    def __init__(self, token_blocks: int, block_size: int):
        self.token_blocks = token_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, token_blocks + 1))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    @property
    def used_blocks(self) -> frozenset[int]:
        return frozenset(self._used)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise PoolExhaustedError(f"asked for {num_blocks} token blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if block not in self._used:
                raise PoolInvariantError(f"token block {block} freed but not allocated (double free or null block)")
            self._used.remove(block)
            self._free.append(block)

    def check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolInvariantError("a token block is on the free list twice")
        if free & self._used:
            raise PoolInvariantError(f"token blocks both free and used: {sorted(free & self._used)[:8]}")
        if free | self._used != set(range(1, self.token_blocks + 1)):
            raise PoolInvariantError("token blocks leaked or out of range (the null block must never be handed out)")


class StateSlotPool:
    """Free list of usable state slots 1..state_slots; slot 0 is the null slot."""

    def __init__(self, state_slots: int):
        self.state_slots = state_slots
        self._free: deque[int] = deque(range(1, state_slots + 1))
        self._used: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return len(self._used)

    @property
    def used_slots(self) -> frozenset[int]:
        return frozenset(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise PoolExhaustedError("asked for a state slot, none free")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise PoolInvariantError(f"state slot {slot} freed but not allocated (double free or null slot)")
        self._used.remove(slot)
        self._free.append(slot)

    def check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolInvariantError("a state slot is on the free list twice")
        if free & self._used or free | self._used != set(range(1, self.state_slots + 1)):
            raise PoolInvariantError("state slots leaked, double-held or out of range")


class CacheManager:
    """Owns both pools, their tensors, and which request holds which blocks and slot."""

    def __init__(self, token_blocks: int, state_slots: int, block_size: int, shapes: PoolShapes,
                 device: torch.device):
        """Allocates the tensors `shapes` (hybridkv.sizing's statement of the pools) describes, plus the null block 0
        and the null slot 0."""
        self.block_size = block_size
        self.shapes = shapes
        self.device = device
        self.blocks = TokenBlockPool(token_blocks, block_size)
        self.slots = StateSlotPool(state_slots)
        kv_shape = (token_blocks + 1, block_size, *shapes.kv_token_shape)
        kv_dtype = TORCH_DTYPES[shapes.kv_dtype]
        self.kv_caches = [
            (torch.zeros(kv_shape, dtype=kv_dtype, device=device), torch.zeros(kv_shape, dtype=kv_dtype, device=device))
            for _ in range(shapes.num_full_attention_layers)
        ]
        self.state_caches = [
            (torch.zeros((state_slots + 1, *shapes.conv_slot_shape), dtype=TORCH_DTYPES[shapes.conv_dtype],
                         device=device),
             torch.zeros((state_slots + 1, *shapes.ssm_slot_shape), dtype=TORCH_DTYPES[shapes.ssm_dtype],
                         device=device))
            for _ in range(shapes.num_linear_attention_layers)
        ]

    # --- bytes actually allocated (null block / slot included) ---
    @property
    def token_pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv_caches for t in pair)

    @property
    def state_pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.state_caches for t in pair)

    # --- admission arithmetic ---
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_new_tokens` more tokens beyond those already computed."""
        total = blocks_for_tokens(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    def tokens_that_fit(self, seq: Sequence) -> int:
        """How many new tokens `seq` could take with its own blocks plus every free block."""
        held = (len(seq.block_table) + self.blocks.num_free_blocks) * self.block_size
        return max(0, held - seq.num_computed_tokens)

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.blocks.num_free_blocks

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.slots.num_free_slots > 0 and self.can_grow(seq, num_new_tokens)

    # --- allocation ---
    def assign_slot(self, seq: Sequence) -> None:
        """Give `seq` a state slot; the step that first runs it zeroes it (`zero_slots`), on every rank."""
        if seq.state_slot:
            raise PoolInvariantError(f"request {seq.request_id} already holds state slot {seq.state_slot}")
        seq.state_slot = self.slots.allocate()

    def zero_slots(self, slots: list[int]) -> None:
        """Zero the conv and recurrent state of `slots` in every GDN layer: one fill per pool tensor."""
        index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        for conv_state, ssm_state in self.state_caches:
            conv_state.index_fill_(0, index, 0)
            ssm_state.index_fill_(0, index, 0)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        seq.block_table.extend(self.blocks.allocate(self.blocks_needed(seq, num_new_tokens)))

    def release(self, seq: Sequence) -> None:
        """Return everything `seq` holds: at finish, abort and preemption."""
        self.blocks.free(seq.block_table)
        seq.block_table = []
        if seq.state_slot:
            self.slots.free(seq.state_slot)
            seq.state_slot = 0

    # --- invariants ---
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """No leak, no double free, no block or slot held twice, usage == sum over live requests."""
        self.blocks.check()
        self.slots.check()
        held_blocks: set[int] = set()
        held_slots: set[int] = set()
        for seq in live:
            for block in seq.block_table:
                if block in held_blocks or block == 0:
                    raise PoolInvariantError(f"token block {block} held twice or null (request {seq.request_id})")
                held_blocks.add(block)
            if seq.state_slot:
                if seq.state_slot in held_slots:
                    raise PoolInvariantError(f"state slot {seq.state_slot} held twice")
                held_slots.add(seq.state_slot)
            if len(seq.block_table) < blocks_for_tokens(seq.num_computed_tokens, self.block_size):
                raise PoolInvariantError(f"request {seq.request_id} computed more tokens than its blocks hold")
            if seq.num_computed_tokens and not seq.state_slot:
                raise PoolInvariantError(f"request {seq.request_id} has computed tokens but no state slot")
        if held_blocks != self.blocks.used_blocks:
            raise PoolInvariantError(
                f"{self.blocks.num_used_blocks} token blocks in use, live requests hold {len(held_blocks)}"
            )
        if held_slots != self.slots.used_slots:
            raise PoolInvariantError(
                f"{self.slots.num_used_slots} state slots in use, live requests hold {len(held_slots)}"
            )
