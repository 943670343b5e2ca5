"""The dual-pool cache: a paged token pool for attention KV and a slot pool for GDN state.

Token pool: `token_blocks` usable blocks of `block_size` tokens plus the null block 0 (padding rows of a batch write
there; no request ever holds it). State pool: `state_slots` (= max_num_seqs) usable slots plus the null slot 0. The
engine sizes them with `hybridkv.sizing.dual_pool_layout`; the tensors allocated here are exactly the bytes it reports.

Prefix caching (off unless the engine gives checkpoint slots): every full block gets a SHA-256 chained over the
blocks before it (from a root that includes the request's cache salt); blocks are reference-counted and kept on an
LRU list when freed. A GDN state cannot be rebuilt from cached tokens, so the request-constant memory also holds a
checkpoint pool: the conv and recurrent state of every GDN layer at a block boundary, keyed by that boundary's block
hash. A request resumes from the longest prefix that has both its blocks and a checkpoint. A checkpoint is copied
from the request's state slot after a step whose chunk ends on its boundary, or captured by the prefill kernels while
the chunk runs past it (`plan_checkpoints`), so prefills are never cut short to take one.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybridkv.sidecar.core.sequence import Sequence
from hybridkv.sidecar.core.transfer import to_device
from hybridkv.sizing import PoolShapes
from hybridkv.sizing.prefix import PREFILL_CHUNK_TOKENS, SegmentedLru, shared_blocks

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


def chain_block_hashes(parent: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """SHA-256 of each full block of `token_ids`, each chained on the one before it (the first on `parent`), so a
    hash names its block's tokens and everything before them."""
    block_bytes = block_size * array("q").itemsize
    data = array("q", token_ids[: len(token_ids) // block_size * block_size]).tobytes()  # converted once, not per block
    hashes = []
    for start in range(0, len(data), block_bytes):
        parent = hashlib.sha256(parent + data[start:start + block_bytes]).digest()
        hashes.append(parent)
    return hashes


def prefix_root(cache_salt: str | None) -> bytes:
    """The hash every chain starts from: requests with different salts never share a block or a checkpoint."""
    return hashlib.sha256(b"hybridkv-prefix\0" + (cache_salt or "").encode()).digest()


class TokenBlockPool:
    """Usable token blocks 1..token_blocks with reference counts; block 0 is the null block and is never handed out.

    A block is free (no content worth keeping), held (reference count >= 1) or cached: free, but holding the attention
    KV of a full block whose content hash is known, on an LRU list. Allocation takes free blocks first, then evicts
    the least recently released cached block; a prefix hit takes a cached block back (or shares a held one)."""

    def __init__(self, token_blocks: int, block_size: int):
        self.token_blocks = token_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, token_blocks + 1))
        self._refs: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus cached ones it would evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no request holds that keep their KV for a later prefix hit."""
        return len(self._cached)

    @property
    def refs(self) -> dict[int, int]:
        return dict(self._refs)

    @property
    def cached_blocks(self) -> list[int]:
        return list(self._cached)

    def num_cached_among(self, blocks: Iterable[int]) -> int:
        return sum(block in self._cached for block in blocks)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise PoolExhaustedError(f"asked for {num_blocks} token blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def share(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each of `blocks` (each held, or cached and taken back off the LRU)."""
        for block in blocks:
            if block in self._cached:
                del self._cached[block]
                self._refs[block] = 1
            elif block in self._refs:
                self._refs[block] += 1
            else:
                raise PoolInvariantError(f"token block {block} shared but neither held nor cached")

    def register(self, block: int, block_hash: bytes) -> None:
        """`block` (held) now holds the full block `block_hash` names; the first block registered for a hash keeps it."""
        if block not in self._refs:
            raise PoolInvariantError(f"token block {block} registered but not held")
        if block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each of `blocks`; an unreferenced block is cached if it has a hash, else free."""
        for block in blocks:
            refs = self._refs.get(block)
            if refs is None:
                raise PoolInvariantError(f"token block {block} freed but not allocated (double free or null block)")
            if refs > 1:
                self._refs[block] = refs - 1
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolInvariantError("a token block is on the free list twice")
        held, cached = set(self._refs), set(self._cached)
        if free & held or free & cached or held & cached:
            raise PoolInvariantError("a token block is in two of free, held and cached")
        if free | held | cached != set(range(1, self.token_blocks + 1)):
            raise PoolInvariantError("token blocks leaked or out of range (the null block must never be handed out)")
        if any(refs < 1 for refs in self._refs.values()):
            raise PoolInvariantError("a held token block has no reference")
        if free & set(self._hash_of) or not cached <= set(self._hash_of):
            raise PoolInvariantError("a free block keeps a hash, or a cached block has none")
        if {block: h for h, block in self._block_of.items()} != self._hash_of:
            raise PoolInvariantError("the block-to-hash and hash-to-block maps disagree")


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


class CheckpointKind(enum.Enum):
    """Where a checkpoint was taken; prefix-cache hits are counted per kind."""

    PROMPT_END = "prompt_end"
    INSIDE_PROMPT = "inside_prompt"  # every checkpoint interval, and where a prompt leaves a cached prefix
    OUTPUT_END = "output_end"


@dataclass(frozen=True)
class Checkpoint:
    slot: int
    kind: CheckpointKind


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint slot a step writes with `seq`'s state after `boundary_tokens` tokens; it gets its key (that
    boundary's block hash) once the host knows those tokens."""

    slot: int
    boundary_tokens: int
    kind: CheckpointKind
    shared: bool = False  # a waiting request shares the prefix up to it: it starts protected


class CheckpointPool:
    """Checkpoint slots 0..checkpoint_slots-1 (no null slot: only restores read them). A slot is free, pending (a
    step writes it, its key not known yet) or keyed by a block-boundary hash; keyed ones are evicted in the order of
    `SegmentedLru` (hybridkv.sizing.prefix: new ones first, those used again or taken where waiting prompts part
    from the prefix protected). Reserving a slot takes a free one, else evicts. Pending slots are never evicted."""

    def __init__(self, checkpoint_slots: int):
        self.checkpoint_slots = checkpoint_slots
        self._free: deque[int] = deque(range(checkpoint_slots))
        self._pending: set[int] = set()
        self._keyed: dict[bytes, Checkpoint] = {}
        self._order = SegmentedLru(checkpoint_slots)

    @property
    def num_keyed(self) -> int:
        return len(self._keyed)

    @property
    def num_protected(self) -> int:
        return self._order.num_protected

    @property
    def protected_limit(self) -> int:
        return self._order.protected_limit

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def pinned(self) -> dict[bytes, int]:
        """Keyed checkpoints running requests keep from eviction, and how many keep each (`SegmentedLru.pin`)."""
        return self._order.pins

    @property
    def keys(self) -> list[bytes]:
        """Keyed checkpoints, the next to be evicted first."""
        return self._order.keys

    def __contains__(self, key: bytes) -> bool:
        return key in self._keyed

    def lookup(self, key: bytes) -> Checkpoint | None:
        return self._keyed.get(key)

    def touch(self, key: bytes) -> None:
        """`key` was used again (a request resumes from it, or would have written it)."""
        self._order.touch(key)

    def refresh(self, key: bytes) -> None:
        """`key` is wanted again soon (see `SegmentedLru.refresh`); nothing if it was evicted meanwhile."""
        if key in self._keyed:
            self._order.refresh(key)

    def pin(self, key: bytes) -> bool:
        """Keep keyed `key` from eviction until `unpin`; False when it is not keyed or half the slots are kept."""
        return self._order.pin(key)

    def unpin(self, key: bytes) -> None:
        self._order.unpin(key)

    def reserve(self) -> int | None:
        """A slot for a new checkpoint, or None when every slot is pending or kept."""
        if self._free:
            slot = self._free.popleft()
        else:
            key = self._order.evict()
            if key is None:
                return None
            slot = self._keyed.pop(key).slot
        self._pending.add(slot)
        return slot

    def take_back(self, key: bytes) -> int:
        """Un-key `key`'s slot and make it pending again, to be overwritten (a request's rolling output checkpoint)."""
        slot = self._keyed.pop(key).slot
        self._order.remove(key)
        self._pending.add(slot)
        return slot

    def settle(self, slot: int, key: bytes | None, kind: CheckpointKind, shared: bool = False) -> None:
        """A pending slot's write is launched: key it (protected from the start when `shared`), or free it when its
        key is unknown or already kept."""
        self._pending.remove(slot)
        if key is None or key in self._keyed:
            self._free.append(slot)
            return
        self._keyed[key] = Checkpoint(slot, kind)
        self._order.add(key, protected=shared)

    def check(self) -> None:
        free = set(self._free)
        keyed = {checkpoint.slot for checkpoint in self._keyed.values()}
        if len(free) != len(self._free) or len(keyed) != len(self._keyed):
            raise PoolInvariantError("a checkpoint slot is free twice or keyed twice")
        if free & self._pending or free & keyed or self._pending & keyed:
            raise PoolInvariantError("a checkpoint slot is in two of free, pending and keyed")
        if free | self._pending | keyed != set(range(self.checkpoint_slots)):
            raise PoolInvariantError("checkpoint slots leaked or out of range")
        if len(self._order) != len(self._keyed) or set(self._order.keys) != self._keyed.keys():
            raise PoolInvariantError("the eviction order does not hold exactly the keyed checkpoints")
        if problems := self._order.problems():
            raise PoolInvariantError(f"checkpoint eviction order: {'; '.join(problems)}")


@dataclass(frozen=True)
class PrefixHit:
    """The cached prefix a waiting request resumes from: its blocks and the checkpoint at their end."""

    blocks: list[int]
    checkpoint: Checkpoint | None  # None: blocks are cached but no boundary has a checkpoint, so nothing resumes
    key: bytes | None

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size if self.checkpoint else 0


class CacheManager:
    """Owns both pools, their tensors, which request holds which blocks and slot, and with prefix caching on
    (`checkpoint_slots` > 0) the block hashes and the checkpoint pool."""

    def __init__(self, token_blocks: int, state_slots: int, block_size: int, shapes: PoolShapes,
                 device: torch.device, checkpoint_slots: int = 0, checkpoint_interval_tokens: int = 0):
        """Allocates the tensors `shapes` (hybridkv.sizing's statement of the pools) describes, plus the null block 0
        and the null slot 0, and `checkpoint_slots` checkpoints of one request's state each."""
        self.block_size = block_size
        self.shapes = shapes
        self.device = torch.device(device)
        self.blocks = TokenBlockPool(token_blocks, block_size)
        self.slots = StateSlotPool(state_slots)
        self.checkpoints = CheckpointPool(checkpoint_slots)
        self.prefix_caching = checkpoint_slots > 0
        self.checkpoint_interval_tokens = checkpoint_interval_tokens
        kv_shape = (token_blocks + 1, block_size, *shapes.kv_token_shape)
        kv_dtype = TORCH_DTYPES[shapes.kv_dtype]
        self.kv_caches = [
            (torch.zeros(kv_shape, dtype=kv_dtype, device=device), torch.zeros(kv_shape, dtype=kv_dtype, device=device))
            for _ in range(shapes.num_full_attention_layers)
        ]
        # Each pool is one (conv, recurrent) pair of tensors with the GDN layers first, and each layer gets its views:
        # a slot's copy or zeroing is then one launch per tensor for every layer at once, not one per layer.
        self._state_stacks = self._state_tensors(state_slots + 1)
        self._checkpoint_stacks = self._state_tensors(checkpoint_slots) if checkpoint_slots else ()
        self.state_caches = self._layer_views(self._state_stacks)
        self.checkpoint_caches = self._layer_views(self._checkpoint_stacks)

    def _state_tensors(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        shapes, device, layers = self.shapes, self.device, self.shapes.num_linear_attention_layers
        return (
            torch.zeros((layers, rows, *shapes.conv_slot_shape), dtype=TORCH_DTYPES[shapes.conv_dtype], device=device),
            torch.zeros((layers, rows, *shapes.ssm_slot_shape), dtype=TORCH_DTYPES[shapes.ssm_dtype], device=device),
        )

    @staticmethod
    def _layer_views(stacks) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (conv, recurrent) pair per GDN layer: contiguous views of the stacked pool, slots first."""
        return [(conv, ssm) for conv, ssm in zip(*stacks)] if stacks else []

    # --- bytes actually allocated (null block / slot included) ---
    @property
    def token_pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv_caches for t in pair)

    @property
    def state_pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.state_caches for t in pair)

    @property
    def checkpoint_pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.checkpoint_caches for t in pair)

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

    def can_admit(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """A free slot and the blocks for `num_new_tokens` after the hit, if any (its cached blocks leave the LRU, so
        an allocation can no longer evict them)."""
        if not self.slots.num_free_slots:
            return False
        if hit is None:
            return self.can_grow(seq, num_new_tokens)
        taken_back = self.blocks.num_cached_among(hit.blocks)
        needed = blocks_for_tokens(hit.num_tokens(self.block_size) + num_new_tokens, self.block_size) - len(hit.blocks)
        return needed <= self.blocks.num_free_blocks - taken_back

    # --- prefix caching ---
    def _hashes(self, seq: Sequence) -> list[bytes]:
        """The chained hash of every full block of `seq`'s known tokens (extended as tokens become known)."""
        return self.block_hashes_upto(seq, len(seq.token_ids) // self.block_size)

    def block_hashes_upto(self, seq: Sequence, blocks: int) -> list[bytes]:
        """`seq`'s block hashes, at least its first `blocks` where its known tokens fill them (a prefix of what
        `_hashes` gives: a request compared by its first blocks is not hashed further)."""
        known_blocks = min(blocks, len(seq.token_ids) // self.block_size)
        if len(seq.block_hashes) < known_blocks:
            done = len(seq.block_hashes) * self.block_size
            parent = seq.block_hashes[-1] if seq.block_hashes else prefix_root(seq.params.cache_salt)
            seq.block_hashes.extend(chain_block_hashes(parent, seq.token_ids[done:known_blocks * self.block_size],
                                                       self.block_size))
        return seq.block_hashes

    def find_prefix(self, seq: Sequence) -> PrefixHit | None:
        """The longest prefix of `seq` whose blocks are cached and whose end has a checkpoint, leaving at least one
        token to run (its logits give the next token). Where `seq` leaves the cached blocks beyond that prefix
        becomes one of its checkpoint boundaries (`branch_tokens`): the next request sharing them resumes there."""
        if not self.prefix_caching:
            return None
        hashes = self._hashes(seq)
        blocks, best = [], (0, None, None)
        for block_hash in hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.blocks.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
            checkpoint = self.checkpoints.lookup(block_hash)
            if checkpoint is not None:
                best = (len(blocks), checkpoint, block_hash)
        length, checkpoint, key = best
        seq.branch_tokens = len(blocks) * self.block_size if len(blocks) > length else 0
        if not blocks:
            return None
        return PrefixHit(blocks[:length], checkpoint, key)

    def resume(self, seq: Sequence, hit: PrefixHit) -> tuple[int, int] | None:
        """Give an admitted `seq` (holding its slot) the hit's blocks and tokens; returns the copy (checkpoint slot,
        state slot) every rank makes before the step, or None when no checkpoint matched (the slot starts at zero)."""
        if hit.checkpoint is None:
            return None
        self.blocks.share(hit.blocks)
        self.checkpoints.touch(hit.key)
        seq.block_table = array("q", hit.blocks)
        seq.num_registered_blocks = len(hit.blocks)
        seq.num_computed_tokens = hit.num_tokens(self.block_size)
        return hit.checkpoint.slot, seq.state_slot

    def _prompt_end_tokens(self, seq: Sequence) -> int:
        """The prompt-end checkpoint's boundary: the last block boundary before the tokens the next turn will not
        send again (`resume_tail_tokens`)."""
        return (seq.num_prompt_tokens - seq.params.resume_tail_tokens) // self.block_size * self.block_size

    def checkpoint_boundaries_ahead(self, seq: Sequence) -> list[int]:
        """The prompt boundaries `seq`'s prefill still checkpoints from its computed tokens on, ascending: those
        `plan_checkpoints` picks (every checkpoint interval, where the prompt leaves blocks others cached or a
        waiting prompt leaves it, its last block boundary). A capture inside a chunk may land up to 63 tokens before
        its boundary."""
        start, prompt_end = seq.num_computed_tokens, self._prompt_end_tokens(seq)
        if not self.prefix_caching or start >= prompt_end:
            return []
        ahead = {prompt_end}
        ahead.update(boundary for boundary in (seq.branch_tokens, seq.shared_tokens) if start < boundary < prompt_end)
        interval = self.checkpoint_interval_tokens
        if interval:
            ahead.update(range((start // interval + 1) * interval, prompt_end, interval))
        return sorted(ahead)

    def shared_prefix_tokens(self, seq: Sequence, other: Sequence) -> int:
        """The tokens of the full blocks `seq` and `other` have in common from the start."""
        return shared_blocks(self._hashes(seq), self._hashes(other)) * self.block_size

    def prefix_in_flight(self, seq: Sequence, others: Iterable[Sequence]) -> int:
        """The longest prefix of `seq`'s known tokens (leaving one to run) that one of `others`, still prefilling,
        will checkpoint: a boundary ahead of it whose block hash `seq` shares (the hashes chain, so the whole prefix
        up to it is the same), at the point a chunk from the other's computed tokens captures it (the last 64-token
        chunk start at or before it; none where that is the chunk's start). 0 if none."""
        hashes = self._hashes(seq)
        usable = min(len(hashes), (seq.num_tokens - 1) // self.block_size)
        best = 0
        for other in others:
            if other is seq:
                continue
            start = other.num_computed_tokens
            for boundary in reversed(self.checkpoint_boundaries_ahead(other)):
                point = start + (boundary - start) // PREFILL_CHUNK_TOKENS * PREFILL_CHUNK_TOKENS
                if point <= best:
                    break
                index = boundary // self.block_size - 1
                if point > start and index < usable:
                    other_hashes = self._hashes(other)
                    if index < len(other_hashes) and other_hashes[index] == hashes[index]:
                        best = point
                        break
        return best

    def chunk_end(self, seq: Sequence, computed: int, num_tokens: int) -> int:
        """`num_tokens` of `seq` from `computed`, cut back to a block boundary when the chunk stops short of the
        known tokens (and a block of it remains), so the next chunk starts on one and can take checkpoints inside."""
        end = computed + num_tokens
        if not self.prefix_caching or end >= seq.num_tokens or num_tokens <= end % self.block_size:
            return num_tokens
        return num_tokens - end % self.block_size

    def plan_checkpoints(self, seq: Sequence, num_tokens: int) -> tuple[tuple[int, int] | None, tuple]:
        """The checkpoints of a chunk of `num_tokens` of `seq` from its computed tokens, their slots reserved.

        Boundaries: the prompt's last block boundary, every checkpoint interval inside the prompt, where the prompt
        leaves blocks other requests cached and where a waiting prompt leaves it, when the chunk reaches them; and an
        output block boundary the chunk ends on. One the chunk ends on is saved after the step -> save = (state slot, checkpoint slot). One
        inside the chunk is captured while it runs, at the last of the GDN prefill's 64-token chunk starts at or
        before it (up to 63 tokens earlier; none where that is the chunk's own start, or the chunk starts off a block
        boundary) -> captures = ((tokens into the chunk, checkpoint slot), ...). A chunk never has to end at a
        boundary, so a prompt checkpointed inside runs in as few steps as one that is not."""
        if not self.prefix_caching:
            return None, ()
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
        if start >= seq.num_prompt_tokens and end % self.block_size:
            return None, ()  # past the prompt only an output block boundary the chunk ends on is one
        prompt_end = self._prompt_end_tokens(seq)
        boundaries: dict[int, CheckpointKind] = {}
        if start < prompt_end <= end:
            boundaries[prompt_end] = CheckpointKind.PROMPT_END
        shared = {seq.shared_tokens} if start < seq.shared_tokens < prompt_end else set()  # waiting prompts share it
        for boundary in (seq.branch_tokens, seq.shared_tokens):
            if start < boundary < prompt_end and boundary <= end:
                boundaries[boundary] = CheckpointKind.INSIDE_PROMPT
        interval = self.checkpoint_interval_tokens
        if interval:
            for boundary in range((start // interval + 1) * interval, min(end + 1, prompt_end), interval):
                boundaries.setdefault(boundary, CheckpointKind.INSIDE_PROMPT)
        if end > prompt_end and end % self.block_size == 0 and not seq.params.resume_tail_tokens:
            boundaries[end] = CheckpointKind.OUTPUT_END  # the latest output boundary: where the next turn starts
        save, captures = None, {}
        for boundary, kind in sorted(boundaries.items()):
            if boundary == end:
                slot = self._reserve_checkpoint(seq, end, kind, boundary in shared)
                save = None if slot is None else (seq.state_slot, slot)
                continue
            point = start + (boundary - start) // PREFILL_CHUNK_TOKENS * PREFILL_CHUNK_TOKENS
            if point == start or start % self.block_size or point in captures:
                continue
            slot = self._reserve_checkpoint(seq, point, kind, boundary in shared)
            if slot is not None:
                captures[point] = slot
        return save, tuple((point - start, slot) for point, slot in captures.items())

    def _reserve_checkpoint(self, seq: Sequence, boundary: int, kind: CheckpointKind,
                            shared: bool = False) -> int | None:
        """A checkpoint slot for `seq`'s state after `boundary` tokens, pending until its key is known (`shared`:
        another request shares the prefix up to it); None when a checkpoint with that key exists already (it is
        touched) or every slot is pending."""
        if boundary <= len(seq.token_ids):
            key = self._hashes(seq)[boundary // self.block_size - 1]
            if key in self.checkpoints:
                self.checkpoints.touch(key)
                if kind is CheckpointKind.PROMPT_END:
                    self._note_prompt_checkpoint(seq, key)
                return None
        previous = seq.output_checkpoint_key
        if kind is CheckpointKind.OUTPUT_END and previous is not None and previous in self.checkpoints:
            slot = self.checkpoints.take_back(previous)  # only a request's last output boundary is kept
        else:
            slot = self.checkpoints.reserve()
        if slot is not None:
            seq.pending_checkpoints.append(PendingCheckpoint(slot, boundary, kind, shared))
        return slot

    def commit(self, seq: Sequence) -> None:
        """After a launch or new token ids: hash `seq`'s computed full blocks whose tokens the host knows, so later
        requests can share them, and key its pending checkpoints whose boundary is known."""
        if not self.prefix_caching or (not seq.pending_checkpoints
                                       and seq.num_computed_tokens // self.block_size <= seq.num_registered_blocks):
            return  # no new full block and nothing pending: most decode steps
        hashes = self._hashes(seq)
        computed_blocks = min(len(hashes), seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for index in range(seq.num_registered_blocks, computed_blocks):
            self.blocks.register(seq.block_table[index], hashes[index])
        seq.num_registered_blocks = max(seq.num_registered_blocks, computed_blocks)
        settled = [pending for pending in seq.pending_checkpoints
                   if pending.boundary_tokens <= len(hashes) * self.block_size]
        for pending in settled:
            key = hashes[pending.boundary_tokens // self.block_size - 1]
            self.checkpoints.settle(pending.slot, key, pending.kind, pending.shared)
            if pending.kind is CheckpointKind.OUTPUT_END:
                seq.output_checkpoint_key = key
            elif pending.kind is CheckpointKind.PROMPT_END:
                self._note_prompt_checkpoint(seq, key)
            seq.pending_checkpoints.remove(pending)

    def _note_prompt_checkpoint(self, seq: Sequence, key: bytes) -> None:
        """`key` is `seq`'s prompt-end checkpoint; one whose next turn resumes there (`resume_tail_tokens`) keeps
        it from eviction while it runs, if the pool's limit allows."""
        seq.prompt_checkpoint_key = key
        if seq.params.resume_tail_tokens and seq.pinned_checkpoint_key is None and self.checkpoints.pin(key):
            seq.pinned_checkpoint_key = key

    # --- allocation ---
    def assign_slot(self, seq: Sequence) -> None:
        """Give `seq` a state slot; the step that first runs it zeroes it (`zero_slots`) or restores a checkpoint
        into it, on every rank."""
        if seq.state_slot:
            raise PoolInvariantError(f"request {seq.request_id} already holds state slot {seq.state_slot}")
        seq.state_slot = self.slots.allocate()

    def zero_slots(self, slots: list[int]) -> None:
        """Zero the conv and recurrent state of `slots` in every GDN layer: one fill per pool tensor."""
        index = to_device(slots, torch.long, self.device)
        for stack in self._state_stacks:
            stack.index_fill_(1, index, 0)

    def restore_checkpoints(self, copies: list[tuple[int, int]]) -> None:
        """(checkpoint slot, state slot) pairs: copy each checkpoint into the state slot, every GDN layer."""
        self._copy_state(self._checkpoint_stacks, self._state_stacks, copies)

    def save_checkpoints(self, copies: list[tuple[int, int]]) -> None:
        """(state slot, checkpoint slot) pairs: copy each state slot into the checkpoint, every GDN layer."""
        self._copy_state(self._state_stacks, self._checkpoint_stacks, copies)

    def _copy_state(self, sources, targets, copies: list[tuple[int, int]]) -> None:
        slots = [slot for pair in zip(*copies) for slot in pair]
        source_index, target_index = to_device(slots, torch.long, self.device).split(len(copies))
        for source, target in zip(sources, targets):  # (layers, slots, ...): every layer's rows in one copy
            target.index_copy_(1, target_index, source.index_select(1, source_index))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        seq.block_table.extend(self.blocks.allocate(self.blocks_needed(seq, num_new_tokens)))

    def release(self, seq: Sequence, finished: bool = False) -> None:
        """Return everything `seq` holds: at finish, abort and preemption. Its hashed blocks stay cached, its last
        block first on the LRU (a prefix outlives its tail); a checkpoint whose key is still unknown is dropped.

        A `finished` request's checkpoint its conversation's next turn resumes from becomes the most recently used
        (not counted as a use): the output end's, or the prompt end's when the next turn sends the prompt's tail
        differently (`resume_tail_tokens`: a client re-rendering the history through a chat template that rewrites
        earlier replies). That one was taken a whole reply earlier, and kept from eviction while the request ran."""
        self.commit(seq)
        if seq.pinned_checkpoint_key is not None:
            self.checkpoints.unpin(seq.pinned_checkpoint_key)
            seq.pinned_checkpoint_key = None
        if finished and self.prefix_caching:
            key = seq.prompt_checkpoint_key if seq.params.resume_tail_tokens else seq.output_checkpoint_key
            if key is not None:
                self.checkpoints.refresh(key)
        for pending in seq.pending_checkpoints:
            self.checkpoints.settle(pending.slot, None, pending.kind)
        seq.pending_checkpoints = []
        self.blocks.free(reversed(seq.block_table))
        seq.block_table = array("q")
        seq.num_registered_blocks = 0
        if seq.state_slot:
            self.slots.free(seq.state_slot)
            seq.state_slot = 0

    # --- invariants ---
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """No leak, no double free, no slot held twice, each block's references == the live requests holding it,
        checkpoint slots free, pending (held by a live request) or keyed, and those kept from eviction kept by live
        requests."""
        self.blocks.check()
        self.slots.check()
        self.checkpoints.check()
        held_blocks: dict[int, int] = {}
        held_slots: set[int] = set()
        pending = 0
        kept: dict[bytes, int] = {}
        for seq in live:
            if seq.pinned_checkpoint_key is not None:
                kept[seq.pinned_checkpoint_key] = kept.get(seq.pinned_checkpoint_key, 0) + 1
            if len(set(seq.block_table)) != len(seq.block_table) or 0 in seq.block_table:
                raise PoolInvariantError(f"request {seq.request_id} holds a token block twice or the null block")
            for block in seq.block_table:
                held_blocks[block] = held_blocks.get(block, 0) + 1
            if seq.state_slot:
                if seq.state_slot in held_slots:
                    raise PoolInvariantError(f"state slot {seq.state_slot} held twice")
                held_slots.add(seq.state_slot)
            if len(seq.block_table) < blocks_for_tokens(seq.num_computed_tokens, self.block_size):
                raise PoolInvariantError(f"request {seq.request_id} computed more tokens than its blocks hold")
            if seq.num_computed_tokens and not seq.state_slot:
                raise PoolInvariantError(f"request {seq.request_id} has computed tokens but no state slot")
            if seq.pending_checkpoints and not seq.state_slot:
                raise PoolInvariantError(f"request {seq.request_id} writes a checkpoint but holds no state slot")
            pending += len(seq.pending_checkpoints)
        if held_blocks != self.blocks.refs:
            raise PoolInvariantError(
                f"{self.blocks.num_used_blocks} token blocks in use, live requests hold {len(held_blocks)} "
                "(or their reference counts differ)"
            )
        if held_slots != self.slots.used_slots:
            raise PoolInvariantError(
                f"{self.slots.num_used_slots} state slots in use, live requests hold {len(held_slots)}"
            )
        if pending != self.checkpoints.num_pending:
            raise PoolInvariantError(
                f"{self.checkpoints.num_pending} checkpoint slots pending, live requests write {pending}"
            )
        if kept != self.checkpoints.pinned:
            raise PoolInvariantError(f"{len(self.checkpoints.pinned)} checkpoints kept from eviction, live "
                                     f"requests keep {len(kept)} (or their counts differ)")
