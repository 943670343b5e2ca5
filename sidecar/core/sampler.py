"""Token sampling over a batch of logits rows, and the per-request text and stop handling around it.

Sampling draws with the exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from p. A request
with a seed draws its noise from its own generator, so its tokens do not depend on what else is in the batch. Every
per-row value the sampler needs on the device (row indices, temperatures, cuts, penalties) goes there through
`to_device`, so sampling never makes the host wait for the step it follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.sidecar.core.outputs import TokenLogprobs
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.core.transfer import to_device


@dataclass
class SamplingState:
    """What the sampler keeps per request across steps: its parameters, its generator if seeded, and for a penalized
    request the counts its penalties read."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: tuple[int, ...] = ()
    # Penalized requests only, made at their first step ([vocab] on the logits' device): how often each id was
    # generated, and which ids the prompt holds. The sampler adds each sampled id on the device, so the host never
    # waits for a token to count it.
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    # min_tokens: the ids it keeps from being sampled, how many tokens were sampled so far, and those ids on the
    # logits' device (made at the first step).
    min_tokens_banned: tuple[int, ...] = ()
    sampled: int = 0
    banned_ids: torch.Tensor | None = None
    # Requests with a logit_bias only, made at their first step: its token ids and biases on the logits' device.
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None


@dataclass
class SampledTokens:
    """One step's sampled ids ([N] int64), and for the rows that asked for logprobs ([R] and [R, K], K the largest
    count asked) the sampled ids' and the top ids' log-probabilities."""

    token_ids: torch.Tensor
    logprob_rows: list[int]
    top_counts: list[int]
    chosen_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self) -> SampledTokens:
        """Copies that arrive on the host without the caller waiting (pinned memory); valid once the device's stream
        reaches this point."""
        def copy(tensor):
            if tensor is None:
                return None
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=True)

        return SampledTokens(copy(self.token_ids), self.logprob_rows, self.top_counts, copy(self.chosen_logprobs),
                             copy(self.top_ids), copy(self.top_logprobs))

    def logprobs_per_row(self) -> list[TokenLogprobs | None]:
        """Host lists: one entry per row, None where the request asked for no logprobs."""
        per_row: list[TokenLogprobs | None] = [None] * len(self.token_ids)
        if not self.logprob_rows:
            return per_row
        chosen = self.chosen_logprobs.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        for i, (row, count) in enumerate(zip(self.logprob_rows, self.top_counts)):
            per_row[row] = TokenLogprobs(chosen[i], tuple(zip(top_ids[i][:count], top_logprobs[i][:count])))
        return per_row


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def new_state(self, params: SamplingParams, prompt_token_ids=(), eos_token_ids=()) -> SamplingState:
        """A request's state; `eos_token_ids` are the ids `params.min_tokens` keeps from being sampled early."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return SamplingState(params, generator, tuple(prompt_token_ids) if params.penalized else (),
                             min_tokens_banned=params.min_tokens_banned_ids(eos_token_ids))

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        """logits [N, vocab] float32, one row per state -> one token id per row."""
        return self.sample(logits, states).token_ids.tolist()

    # The runner's logits are inference tensors; penalties update them and the per-request counts in place.
    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SampledTokens:
        """As `__call__`, but everything stays on the logits' device and the host does not wait for it. `logits` is
        overwritten. Logprobs are those of the model's own distribution, before logit_bias, penalties, temperature and
        cuts."""
        logprob_rows = [row for row, state in enumerate(states) if state.params.logprobs is not None]
        model_logprobs = None
        if logprob_rows:
            logprob_index = to_device(logprob_rows, torch.long, logits.device)
            model_logprobs = logits.index_select(0, logprob_index).log_softmax(dim=-1)
        adjusted = [row for row, state in enumerate(states) if state.params.logit_bias or state.min_tokens_banned]
        if adjusted:
            self._apply_logit_bias(logits, states, adjusted)
            self._ban_before_min_tokens(logits, states, adjusted)
        penalized_rows = self._apply_penalties(logits, states)
        tokens = logits.argmax(dim=-1)
        random_rows = [row for row, state in enumerate(states) if not state.params.greedy]
        if random_rows:
            tokens = tokens.index_copy(0, to_device(random_rows, torch.long, logits.device),
                                       self._draw(logits, states, random_rows))
        for row in penalized_rows:
            counts = states[row].output_counts
            counts.index_add_(0, tokens[row:row + 1], torch.ones(1, device=counts.device, dtype=counts.dtype))
        top_counts = [states[row].params.logprobs for row in logprob_rows]
        sampled = SampledTokens(tokens, logprob_rows, top_counts)
        if logprob_rows:
            chosen = tokens.index_select(0, logprob_index).unsqueeze(1)
            sampled.chosen_logprobs = model_logprobs.gather(1, chosen).squeeze(1)
            sampled.top_logprobs, sampled.top_ids = model_logprobs.topk(max(max(top_counts), 1), dim=-1)
        return sampled

    def _draw(self, logits: torch.Tensor, states: list[SamplingState], random_rows: list[int]) -> torch.Tensor:
        rows = to_device(random_rows, torch.long, logits.device)
        probs = self._probabilities(logits.index_select(0, rows), [states[row].params for row in random_rows])
        noise = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(random_rows) if states[row].generator is None]
        if len(unseeded) == len(random_rows):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise.index_copy_(0, to_device(unseeded, torch.long, probs.device),
                              torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                                  generator=self.generator))
        for i, row in enumerate(random_rows):
            if states[row].generator is not None:
                noise[i].exponential_(generator=states[row].generator)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, states: list[SamplingState], rows: list[int]) -> None:
        """Each biased request's logit_bias added to its row, in place (one launch per such row)."""
        for row in rows:
            state = states[row]
            if not state.params.logit_bias:
                continue
            if state.bias_ids is None:
                ids, values = zip(*state.params.logit_bias)
                state.bias_ids = to_device(ids, torch.long, logits.device)
                state.bias_values = to_device(values, logits.dtype, logits.device)
            logits[row].index_add_(0, state.bias_ids, state.bias_values)

    @staticmethod
    def _ban_before_min_tokens(logits: torch.Tensor, states: list[SamplingState], rows: list[int]) -> None:
        """Rows short of their min_tokens cannot sample end-of-sequence or a stop token id; counts this step."""
        for row in rows:
            state = states[row]
            if not state.min_tokens_banned or state.sampled >= state.params.min_tokens:
                continue
            if state.banned_ids is None:
                state.banned_ids = to_device(state.min_tokens_banned, torch.long, logits.device)
            logits[row].index_fill_(0, state.banned_ids, float("-inf"))
            state.sampled += 1

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        """Repetition penalty over prompt and output ids, then frequency and presence penalties over output ids, in
        place on the penalized rows; returns those rows."""
        rows = [row for row, state in enumerate(states) if state.params.penalized]
        if not rows:
            return rows
        vocab = logits.shape[1]
        for row in rows:
            state = states[row]
            if state.output_counts is None:
                state.output_counts = torch.zeros(vocab, device=logits.device, dtype=logits.dtype)
                state.prompt_mask = torch.zeros(vocab, device=logits.device, dtype=torch.bool)
                # index_fill_ with a Python scalar: an indexed assignment of True would copy the scalar from the
                # host and wait for the device.
                state.prompt_mask.index_fill_(0, to_device(state.prompt_token_ids, torch.long, logits.device), True)
        index = to_device(rows, torch.long, logits.device)
        params = [states[row].params for row in rows]

        def column(values):
            return to_device(values, logits.dtype, logits.device).unsqueeze(1)

        counts = torch.stack([states[row].output_counts for row in rows])
        generated = counts > 0
        seen = generated | torch.stack([states[row].prompt_mask for row in rows])
        selected = logits.index_select(0, index)
        repetition = column([p.repetition_penalty for p in params])
        selected = torch.where(seen, torch.where(selected > 0, selected / repetition, selected * repetition), selected)
        selected -= column([p.frequency_penalty for p in params]) * counts
        selected -= column([p.presence_penalty for p in params]) * generated
        logits.index_copy_(0, index, selected)
        return rows

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k, then top-p over the top-k distribution and min-p against its most likely token
        (neither drops that token, so the two commute); masked entries get probability 0. `logits` is overwritten;
        in-place steps keep the peak at a few vocabulary-wide rows per request."""
        temperature = to_device([p.temperature for p in params], logits.dtype, logits.device)
        vocab = logits.shape[1]
        logits.div_(temperature.unsqueeze(1))
        if not any(0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            # No cut, so no sort: the softmax in place (the sort below would keep every token).
            logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
            return logits.div_(logits.sum(dim=-1, keepdim=True))
        top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long, logits.device)
        # A top_p below float32's smallest normal rounds to 0 on the device, which would drop every token.
        top_p = to_device([p.top_p for p in params], logits.dtype, logits.device).clamp_(
            min=torch.finfo(logits.dtype).tiny)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        del sorted_logits
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
        sorted_probs.masked_fill_(mass_before >= top_p.unsqueeze(1), 0.0)
        del mass_before
        if any(p.min_p > 0.0 for p in params):
            min_p = to_device([p.min_p for p in params], logits.dtype, logits.device)
            sorted_probs.masked_fill_(sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1], 0.0)
        return logits.scatter_(1, order, sorted_probs)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, holding back incomplete UTF-8 and possible stop-string
    prefixes so streamed text never has to be taken back. Each new id goes through the tokenizers library's
    `DecodeStream` (`step`), which decodes it in the context of the ids before it (byte-level merges across the
    boundary decode right) and yields nothing while the ids end inside a character: one call into the library per
    request and step, where decoding two id windows per request in one batch cost three times as much host time (at 64
    requests of a 248k-token byte-level vocabulary, 0.65-0.74 against 0.20 ms a step on the dev CPU)."""

    __slots__ = ("stop", "min_tokens", "include_stop", "_holdback", "pending", "emitted_chars", "_prefix_offset",
                 "_read_offset", "_ids", "_stream")

    def __init__(self, stop: tuple[str, ...] = (), min_tokens: int = 0, include_stop: bool = False):
        from tokenizers.decoders import DecodeStream

        self.stop = stop
        self.min_tokens = min_tokens  # stop strings end the request only from this many tokens on
        self.include_stop = include_stop  # the text keeps the stop string that ended it
        self._holdback = max((len(s) for s in stop), default=1) - 1  # chars that could begin a stop string
        # Decoded text not yet emitted (cut at a stop string when one is found): at most the stop strings' holdback
        # and the newest piece between deltas, so a step's work does not grow with the output's length.
        self.pending = ""
        self.emitted_chars = 0
        # The ids of the last text taken start at _prefix_offset and end at _read_offset; ids past it are still
        # inside a character.
        self._prefix_offset = 0
        self._read_offset = 0
        self._ids: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, tokenizer, token_id: int) -> bool:
        """Take one generated id; returns True when a stop string appeared (see `take`)."""
        self._ids.append(token_id)
        piece = self._stream.step(tokenizer.backend, token_id)
        if piece is None:
            return False  # an incomplete multi-byte character (or a skipped special token): nothing new yet
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self.take(piece, len(self._ids))

    def take(self, piece: str, num_ids: int) -> bool:
        """Append decoded text that `num_ids` generated ids make up so far; returns True when a stop string appeared
        (the text is cut before it, or after it with `include_stop`)."""
        # A stop string ending in the piece starts at most `_holdback` characters before it, which `delta` has held
        # back.
        search_from = max(0, len(self.pending) - self._holdback)
        self.pending += piece
        if self.stop and num_ids >= self.min_tokens:
            found = [(index, stop) for stop in self.stop if (index := self.pending.find(stop, search_from)) >= 0]
            if found:
                index, stop = min(found, key=lambda hit: (hit[0], -len(hit[1])))
                self.pending = self.pending[:index + len(stop) if self.include_stop else index]
                return True
        return False

    def flush(self, tokenizer) -> None:
        """At finish: take in the ids still held back as an incomplete character (as replacement characters)."""
        if self._read_offset < len(self._ids):
            prefix_text, new_text = tokenizer.decode_batch(
                [self._ids[self._prefix_offset:self._read_offset], self._ids[self._prefix_offset:]])
            self.pending += new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)

    def delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, the tail that could start a stop string is held back."""
        end = len(self.pending)
        if not finished and self.stop:
            end = max(0, end - self._holdback)
        piece, self.pending = self.pending[:end], self.pending[end:]
        self.emitted_chars += end
        return piece


def detokenize_step(tokenizer, detokenizers: list[IncrementalDetokenizer], token_ids: list[int]) -> list[bool]:
    """Feed one new id to each detokenizer; returns which hit a stop string."""
    return [detokenizer.step(tokenizer, token_id) for detokenizer, token_id in zip(detokenizers, token_ids)]
