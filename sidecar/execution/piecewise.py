"""Mixed and prefill steps replayed as CUDA graphs piece by piece.

Decode steps replay one CUDA graph each; a step that prefills cannot, because its token mixers read the step's
sequences (their number, lengths and caches) through kernels whose grids follow them. Everything else in the step
is token-wise: embeddings, norms, projections, rotary, MLPs and MoE blocks treat each row on its own, so for a given
number of rows it launches the same kernels every time. Launched eagerly, that work is most of a mixed step's host
time (a step of 64 decodes and 256 prompt tokens took 60 ms to launch on the H200's host, and its device was done
0.3 ms later; docs/performance.md).

`PiecewiseGraphs` captures the model's token-wise pieces (`Qwen3_5TextModel.piece`) once per token bucket and runs a
step as: pieces replayed at the bucket at or above its token count, each layer's `mix` run eagerly between two of
them on the step's real rows. Rows past the step's tokens are padding; token-wise work on them is discarded.

Memory: a piece's outputs are copied into arenas shared by every piece and bucket (two sets, so a piece never
writes what it reads), and every capture draws its intermediates from one graph pool, so the pieces hold only the
arenas and the pool's largest piece at the largest bucket (`arena_bytes`), not a copy of every piece's outputs
per bucket.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridkv.sidecar.model.context import BatchContext

# Buckets every 16 tokens up to 256, then every 32, 64, 128 and 256 (padding adds at most 1/8 of a step's rows).
_BUCKET_STEPS = ((256, 16), (512, 32), (1024, 64), (2048, 128))
_LARGE_BUCKET_STEP = 256


def token_buckets(max_tokens: int) -> list[int]:
    """The token counts captured for steps of up to `max_tokens` tokens; the last is `max_tokens` itself."""
    buckets, size = [], 0
    while size < max_tokens:
        step = next((step for end, step in _BUCKET_STEPS if size < end), _LARGE_BUCKET_STEP)
        size = min(size + step, max_tokens)
        buckets.append(size)
    return buckets


@dataclass(frozen=True)
class _Spec:
    """The per-row shape and dtype of one tensor a piece hands on."""

    tail: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        numel = 1
        for size in self.tail:
            numel *= size
        return numel * self.dtype.itemsize


class _Arena:
    """A flat byte buffer viewed as one tensor of `rows` rows at a time."""

    def __init__(self, num_bytes: int, device: torch.device):
        self.storage = torch.zeros(num_bytes, dtype=torch.uint8, device=device)

    def view(self, spec: _Spec, rows: int) -> torch.Tensor:
        return self.storage[: rows * spec.row_bytes].view(spec.dtype).view(rows, *spec.tail)


class CudaGraphPiece:
    """A captured piece: `capture(fn)` records it into the shared pool, `replay()` launches it."""

    def __init__(self, pool):
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        with torch.cuda.graph(self._graph, pool=self._pool):
            fn()

    def replay(self) -> None:
        self._graph.replay()


class PiecewiseGraphs:
    """The token-wise pieces of `model` (a `Qwen3_5TextModel`) captured at each of `buckets` tokens.

    `new_piece(pool)` makes one captured piece (`CudaGraphPiece`; the tests pass a recorder that re-runs the
    function, which checks the buffers' plumbing on CPU) and `pool` is the graph memory pool shared with the decode
    graphs (None on CPU)."""

    def __init__(self, model, buckets: list[int], device: torch.device, pool=None,
                 new_piece: Callable = CudaGraphPiece):
        if not buckets:
            raise ValueError("piecewise graphs need at least one token bucket")
        self.model = model
        self.buckets = sorted(buckets)
        self.device = device
        self._pool = pool
        self._new_piece = new_piece
        self._pieces: dict[int, list] = {}
        self._replay_views: dict[int, tuple] = {}  # per bucket: each piece's arena views, built at its first replay
        self.capture_s = 0.0
        largest = self.buckets[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self._specs = self._piece_specs(largest)
        mixers = [layer.mixer for layer in model.layers]
        dtype = self._specs[0][0].dtype
        self._core_specs = [_Spec(tuple(mixer.core_shape(1)[1:]), dtype) for mixer in mixers]
        # arena j of set s holds output j of the pieces of parity s; one arena holds every layer's `mix` output.
        widths: list[list[int]] = [[], []]
        for index, specs in enumerate(self._specs):
            row = widths[index % 2]
            row.extend([0] * (len(specs) - len(row)))
            for j, spec in enumerate(specs):
                row[j] = max(row[j], spec.row_bytes)
        self._arenas = [[_Arena(width * largest, device) for width in row] for row in widths]
        self._core = _Arena(max(spec.row_bytes for spec in self._core_specs) * largest, device)

    def arena_storages(self) -> list[torch.Tensor]:
        """The byte buffers the pieces hand tensors on through (both sets, then the mix outputs')."""
        return [arena.storage for row in self._arenas for arena in row] + [self._core.storage]

    @property
    def arena_bytes(self) -> int:
        return sum(storage.numel() for storage in self.arena_storages())

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest captured bucket that holds `num_tokens` rows, or None when none does."""
        index = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[index] if index < len(self.buckets) else None

    # --- capture ---
    def _piece_specs(self, rows: int) -> list[list[_Spec]]:
        """Run the pieces eagerly at `rows` tokens (each layer's mix output zeros) and note what each hands on."""
        specs, carry = [], ()
        mixers = [layer.mixer for layer in self.model.layers]
        with torch.inference_mode():
            for index in range(self.model.num_pieces):
                if index:
                    like = carry[1]
                    carry = (*carry, torch.zeros(mixers[index - 1].core_shape(rows), dtype=like.dtype,
                                                 device=self.device))
                carry = self.model.piece(index, self.input_ids[:rows], self.positions[:rows], carry)
                specs.append([_Spec(tuple(t.shape[1:]), t.dtype) for t in carry])
        return specs

    def _outputs(self, index: int, rows: int) -> list[torch.Tensor]:
        return [self._arenas[index % 2][j].view(spec, rows) for j, spec in enumerate(self._specs[index])]

    def _inputs(self, index: int, rows: int) -> tuple[torch.Tensor, ...]:
        if index == 0:
            return ()
        return (*self._outputs(index - 1, rows), self._core.view(self._core_specs[index - 1], rows))

    def capture(self) -> None:
        """Capture every piece at every bucket, largest first (the pool's blocks then fit every later capture).
        Each piece runs once eagerly first, so Triton compiles and tunes outside the capture."""
        started = time.monotonic()
        for rows in reversed(self.buckets):
            pieces = []
            for index in range(self.model.num_pieces):
                inputs, outputs = self._inputs(index, rows), self._outputs(index, rows)

                def run(index=index, inputs=inputs, outputs=outputs, rows=rows) -> None:
                    for out, value in zip(outputs, self.model.piece(index, self.input_ids[:rows],
                                                                    self.positions[:rows], inputs)):
                        out.copy_(value)

                with torch.inference_mode():
                    run()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    piece = self._new_piece(self._pool)
                    piece.capture(run)
                pieces.append(piece)
            self._pieces[rows] = pieces
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s = time.monotonic() - started

    # --- replay ---
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """The final hidden rows [T, hidden] of a step of T <= max_tokens tokens (valid until the next run)."""
        num_tokens = input_ids.shape[0]
        rows = self.bucket_for(num_tokens)
        if rows is None or rows not in self._pieces:
            raise ValueError(f"a step of {num_tokens} tokens has no captured bucket (largest {self.max_tokens})")
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        pieces = self._pieces[rows]
        mixers_inputs, hidden = self._views_for(rows)
        layers = self.model.layers
        for index, piece in enumerate(pieces):
            if index:
                projected, core = mixers_inputs[index - 1]
                layers[index - 1].mixer.mix([t[:num_tokens] for t in projected], ctx, out=core[:num_tokens])
                if ctx.between_layers is not None:
                    ctx.between_layers()
            piece.replay()
        return hidden[:num_tokens]

    def _views_for(self, rows: int) -> tuple[list[tuple[list[torch.Tensor], torch.Tensor]], torch.Tensor]:
        """At bucket `rows`: what each layer's mixer reads and writes between the pieces (its projections, the arena
        its output goes to), and the last piece's hidden rows. Views of the fixed arenas, made once per bucket: a
        replay otherwise spends a few hundred small tensor ops remaking them."""
        views = self._replay_views.get(rows)
        if views is None:
            last = len(self._pieces[rows]) - 1
            mixers_inputs = [(self._outputs(index, rows)[1:], self._core.view(self._core_specs[index], rows))
                             for index in range(last)]
            views = self._replay_views[rows] = (mixers_inputs, self._outputs(last, rows)[0])
        return views

    def release(self) -> None:
        self._pieces = {}
        self._replay_views = {}
