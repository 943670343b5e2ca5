"""Token sampling over a batch of logits rows, and the per-request text and stop handling around it.

Sampling draws with the exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from p. A request
with a seed draws its noise from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.sidecar.core.sampling import SamplingParams


@dataclass
class SamplingState:
    """What the sampler keeps per request across steps: its parameters and, if seeded, its generator."""

    params: SamplingParams
    generator: torch.Generator | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def new_state(self, params: SamplingParams) -> SamplingState:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return SamplingState(params, generator)

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        """logits [N, vocab] float32, one row per state -> one token id per row."""
        return self.sample(logits, states).tolist()

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """As `__call__`, but the ids stay on the logits' device ([N] int64) and the host does not wait for them."""
        greedy_tokens = logits.argmax(dim=-1)
        random_rows = [row for row, state in enumerate(states) if not state.params.greedy]
        if not random_rows:
            return greedy_tokens
        rows = torch.tensor(random_rows, device=logits.device)
        params = [states[row].params for row in random_rows]
        probs = self._probabilities(logits.index_select(0, rows), params)
        noise = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(random_rows) if states[row].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        for i, row in enumerate(random_rows):
            if states[row].generator is not None:
                noise[i].exponential_(generator=states[row].generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        return greedy_tokens.index_copy(0, rows, sampled)

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k, then top-p over the sorted distribution; masked entries get probability 0.
        `logits` is overwritten; in-place steps keep the peak at a few vocabulary-wide rows per request."""
        temperature = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
        vocab = logits.shape[1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
        sorted_logits, order = logits.div_(temperature.unsqueeze(1)).sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        del sorted_logits
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
        sorted_probs.masked_fill_(mass_before >= top_p.unsqueeze(1), 0.0)
        del mass_before
        return logits.scatter_(1, order, sorted_probs)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, holding back incomplete UTF-8 and possible stop-string
    prefixes so streamed text never has to be taken back. Decoding is batched over requests: `windows` says which
    ids to decode, `update` takes the decoded strings (see `detokenize_step`)."""

    __slots__ = ("stop", "_holdback", "text", "emitted_chars", "_prefix_offset", "_read_offset", "_ids")

    def __init__(self, stop: tuple[str, ...] = ()):
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1  # chars that could begin a stop string
        self.text = ""  # decoded text so far (cut at a stop string when one is found)
        self.emitted_chars = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self._ids: list[int] = []

    def windows(self, token_id: int) -> tuple[list[int], list[int]]:
        """Append one generated id; returns the id windows whose texts `update` needs (already decoded, and with the
        new id), both starting a few ids back so byte-level merges across the boundary decode right."""
        self._ids.append(token_id)
        return self._ids[self._prefix_offset:self._read_offset], self._ids[self._prefix_offset:]

    def update(self, prefix_text: str, new_text: str) -> bool:
        """Take the decoded windows; returns True when a stop string appeared (text is cut before it)."""
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # an incomplete multi-byte character: wait for the next token
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self.stop:
            found = [index for index in (self.text.find(stop, search_from) for stop in self.stop) if index >= 0]
            if found:
                self.text = self.text[:min(found)]
                return True
        return False

    def flush(self, tokenizer) -> None:
        """At finish: take in the ids still held back as an incomplete character (as replacement characters)."""
        if self._read_offset < len(self._ids):
            prefix_text, new_text = tokenizer.decode_batch(
                [self._ids[self._prefix_offset:self._read_offset], self._ids[self._prefix_offset:]])
            self.text += new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)

    def delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, the tail that could start a stop string is held back."""
        end = len(self.text)
        if not finished and self.stop:
            end = max(self.emitted_chars, end - self._holdback)
        piece = self.text[self.emitted_chars:end]
        self.emitted_chars = end
        return piece


def detokenize_step(tokenizer, detokenizers: list[IncrementalDetokenizer], token_ids: list[int]) -> list[bool]:
    """Feed one new id to each detokenizer with a single batched decode; returns which hit a stop string."""
    windows = [window for detokenizer, token_id in zip(detokenizers, token_ids)
               for window in detokenizer.windows(token_id)]
    texts = tokenizer.decode_batch(windows)
    return [detokenizer.update(texts[2 * i], texts[2 * i + 1]) for i, detokenizer in enumerate(detokenizers)]
