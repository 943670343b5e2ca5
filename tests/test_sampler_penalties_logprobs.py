"""Penalties, min-p and logprobs of the sampler, each against a plain-torch reading of its definition, and the
streamed detokenizing against the windowed decoding it replaces (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine_fixtures import tiny_checkpoint  # noqa: E402,F401 (fixture)

from hybridkv.sidecar.core.sampler import Sampler  # noqa: E402
from hybridkv.sidecar.core.sampling import RequestError, SamplingParams  # noqa: E402

VOCAB = 32


def reference_penalized(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                        params: SamplingParams) -> torch.Tensor:
    """The definitions, one token at a time: CTRL's repetition penalty over prompt and output ids, then OpenAI's
    frequency (per occurrence) and presence (once) penalties over output ids."""
    penalized = logits.clone()
    for token_id in set(prompt_ids) | set(output_ids):
        value = penalized[token_id].item()
        penalized[token_id] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token_id in set(output_ids):
        penalized[token_id] -= params.frequency_penalty * output_ids.count(token_id) + params.presence_penalty
    return penalized


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.0, frequency_penalty=0.9),
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=-0.4, presence_penalty=0.6),
], ids=["repetition", "frequency", "presence", "all three"])
def test_penalized_greedy_tokens_follow_the_definition_over_many_steps(params):
    generator = torch.Generator().manual_seed(3)
    prompt_ids = [1, 2, 3, 2]
    sampler = Sampler(torch.device("cpu"), seed=0)
    state = sampler.new_state(params, prompt_ids)
    # A second, unpenalized request in the same batch must not be affected.
    plain = sampler.new_state(SamplingParams(temperature=0.0))
    output_ids, changed_by_penalty = [], 0
    for _ in range(40):
        # Few strong candidates, so repeats (and therefore penalties) happen.
        logits = torch.randn(VOCAB, generator=generator) * 0.3
        logits[:6] += torch.tensor([3.0, 2.9, 2.8, 2.7, -2.5, 2.6])
        expected = int(reference_penalized(logits, prompt_ids, output_ids, params).argmax())
        changed_by_penalty += expected != int(logits.argmax())
        tokens = sampler(torch.stack([logits, logits]), [state, plain])
        assert tokens == [expected, int(logits.argmax())]
        output_ids.append(expected)
    assert changed_by_penalty >= 2, "the test logits never let the penalty change a token"


def test_penalties_apply_before_temperature_sampling():
    """A sampled (not greedy) request draws from softmax(penalized / T)."""
    params = SamplingParams(temperature=0.8, frequency_penalty=1.0, repetition_penalty=1.2)
    prompt_ids, output_ids = [0], [1, 1, 2]
    logits = torch.tensor([1.5, 1.4, 1.0, 0.5, 0.0])
    sampler = Sampler(torch.device("cpu"), seed=11)
    states = []
    for _ in range(4000):
        state = sampler.new_state(params, prompt_ids)
        state.output_counts = torch.bincount(torch.tensor(output_ids), minlength=5).float()
        state.prompt_mask = torch.zeros(5, dtype=torch.bool)
        state.prompt_mask[prompt_ids] = True
        states.append(state)
    drawn = torch.tensor(sampler(logits.repeat(4000, 1), states))
    frequencies = torch.bincount(drawn, minlength=5).float() / 4000
    expected = torch.softmax(reference_penalized(logits, prompt_ids, output_ids, params) / 0.8, dim=0)
    assert torch.allclose(frequencies, expected, atol=0.03), (frequencies, expected)


def test_min_p_keeps_exactly_the_tokens_within_its_share_of_the_most_likely():
    logits = torch.tensor([2.0, 1.6, 1.0, 0.2, -0.5, -3.0])
    probs = torch.softmax(logits, dim=0)
    min_p = 0.3
    kept = probs >= min_p * probs.max()
    sampler = Sampler(torch.device("cpu"), seed=5)
    drawn = torch.tensor(sampler(logits.repeat(6000, 1), [sampler.new_state(SamplingParams(min_p=min_p))] * 6000))
    frequencies = torch.bincount(drawn, minlength=6).float() / 6000
    expected = torch.where(kept, probs, 0.0)
    expected /= expected.sum()
    assert set(drawn.tolist()) == set(kept.nonzero().flatten().tolist()) == {0, 1, 2}
    assert torch.allclose(frequencies, expected, atol=0.03)


def test_logprobs_are_the_models_log_softmax_of_the_chosen_and_the_top_tokens():
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(3, VOCAB, generator=generator) * 2
    sampler = Sampler(torch.device("cpu"), seed=1)
    states = [sampler.new_state(SamplingParams(temperature=0.0, logprobs=3)),
              sampler.new_state(SamplingParams(temperature=0.0)),
              sampler.new_state(SamplingParams(temperature=1.0, seed=4, logprobs=0, presence_penalty=2.0))]
    sampled = sampler.sample(logits.clone(), states)
    per_row = sampled.logprobs_per_row()
    reference = torch.log_softmax(logits, dim=-1)
    tokens = sampled.token_ids.tolist()
    assert per_row[1] is None
    assert per_row[0].logprob == pytest.approx(reference[0, tokens[0]].item(), abs=1e-6)
    top_values, top_ids = reference[0].topk(3)
    assert [token_id for token_id, _ in per_row[0].top] == top_ids.tolist()
    assert [value for _, value in per_row[0].top] == pytest.approx(top_values.tolist(), abs=1e-6)
    # Logprobs are the model's, before the penalty that shaped the draw; zero alternatives asked, none given.
    assert per_row[2].logprob == pytest.approx(reference[2, tokens[2]].item(), abs=1e-6)
    assert per_row[2].top == ()


def test_logit_bias_is_added_before_greedy_and_sampled_choices_and_not_to_logprobs():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=generator)
    top = int(logits[0].argmax())
    sampler = Sampler(torch.device("cpu"), seed=2)
    states = [sampler.new_state(SamplingParams(temperature=0.0, logit_bias={7: 100.0})),
              sampler.new_state(SamplingParams(temperature=0.0, logit_bias={top: -100.0}, logprobs=1)),
              sampler.new_state(SamplingParams(temperature=0.0)),
              sampler.new_state(SamplingParams(temperature=1.0, seed=3, logit_bias=((9, 100.0), (11, 100.0))))]
    for _ in range(3):  # the device tensors are made once and reused
        sampled = sampler.sample(logits.clone(), states)
        tokens = sampled.token_ids.tolist()
        assert tokens[0] == 7
        assert tokens[1] == int((logits[1] + torch.nn.functional.one_hot(torch.tensor(top), VOCAB) * -100).argmax())
        assert tokens[2] == int(logits[2].argmax())
        assert tokens[3] in (9, 11)
        assert sampled.logprobs_per_row()[1].logprob == pytest.approx(
            torch.log_softmax(logits[1], -1)[tokens[1]].item(), abs=1e-6)


def test_min_tokens_keeps_end_of_sequence_and_stop_ids_out_of_the_first_tokens():
    from hybridkv.sidecar.core.sampler import IncrementalDetokenizer

    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0  # the end-of-sequence id, by far the most likely
    logits[:, 6] = 9.0  # a stop token id, next
    logits[:, 2] = 8.0  # then an ordinary token
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(6,))
    states = [sampler.new_state(params, eos_token_ids=(5,)),
              sampler.new_state(SamplingParams(temperature=0.0), eos_token_ids=(5,))]
    assert states[0].min_tokens_banned == (5, 6) and states[1].min_tokens_banned == ()
    tokens = [sampler(logits.clone(), states) for _ in range(4)]
    assert [row[0] for row in tokens] == [2, 2, 2, 5]
    assert [row[1] for row in tokens] == [5] * 4
    # With eos ignored only the stop ids are held back.
    assert SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=(6,)).min_tokens_banned_ids((5,)) == (6,)
    # Stop strings end the request only from min_tokens tokens on.
    early = IncrementalDetokenizer(("ab",), min_tokens=3)
    assert early.take("ab", 1) is False and early.pending == "ab"
    assert early.take("cab", 2) is False
    assert early.take("ab", 3) is True and early.pending == "abcab"
    # include_stop_str_in_output keeps the stop string, the longest where two start at the same place.
    kept = IncrementalDetokenizer(("yz", "y"), include_stop=True)
    assert kept.take("wxyzq", 1) is True and kept.pending == "wxyz"


def test_a_long_stream_holds_back_only_what_could_start_a_stop_string():
    """Text is held only until it is emitted, so each step's work stays the same however long the output grows; a
    stop string split over pieces many steps in is still found and cut, and what was emitted is all the text."""
    from hybridkv.sidecar.core.sampler import IncrementalDetokenizer

    detokenizer = IncrementalDetokenizer(("</answer>", "\n\nUser:"))
    emitted = []
    for step in range(1, 20_001):
        assert detokenizer.take("wxyz", step) is False
        emitted.append(detokenizer.delta(finished=False))
        assert len(detokenizer.pending) <= len("</answer>") - 1  # the longest stop string, less one
    assert "".join(emitted) + detokenizer.pending == "wxyz" * 20_000
    assert detokenizer.take("ok</ans", 20_001) is False
    emitted.append(detokenizer.delta(finished=False))
    assert detokenizer.take("wer> more", 20_002) is True
    emitted.append(detokenizer.delta(finished=True))
    assert "".join(emitted) == "wxyz" * 20_000 + "ok"
    assert detokenizer.emitted_chars == len("wxyz") * 20_000 + 2


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=4, min_tokens=5), r"min_tokens must be an integer in \[0, max_tokens = 4\]"),
    (SamplingParams(min_tokens=-1), "min_tokens must be an integer"),
    (SamplingParams(min_tokens=True), "min_tokens must be an integer"),
    (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias token id 32 is not in the vocabulary"),
    (SamplingParams(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias token id 1 is given twice"),
    (SamplingParams(logit_bias={1: float("inf")}), r"logit_bias of token 1 must be in \[-100, 100\]"),
    (SamplingParams(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias takes at most 1024 token ids"),
    (SamplingParams(presence_penalty=2.5), "presence_penalty must be in"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty must be in"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be in"),
    (SamplingParams(min_p=1.5), "min_p must be in"),
    (SamplingParams(logprobs=21), "logprobs must be an integer in"),
    (SamplingParams(logprobs=True), "logprobs must be an integer in"),
])
def test_out_of_range_sampling_parameters_are_refused_with_their_name(params, message):
    with pytest.raises(RequestError, match=message):
        params.validate(max_model_len=64, prompt_len=4, vocab_size=VOCAB)


def windowed_texts(tokenizer, ids: list[int]) -> list[str]:
    """The specification of streamed detokenizing: after each id, the text of the ids so far decoded in context (a
    window from the previous piece's start) less the previous piece's, or nothing while it ends in an incomplete
    character."""
    pieces, prefix, read = [], 0, 0
    for end in range(1, len(ids) + 1):
        before, after = tokenizer.decode_batch([ids[prefix:read], ids[prefix:end]])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before):])
            prefix, read = read, end
        else:
            pieces.append("")
    return pieces


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_is_the_windowed_decoding_and_the_whole_decode(tiny_checkpoint, seed):
    import random

    from hybridkv.sidecar.core.sampler import IncrementalDetokenizer, detokenize_step
    from hybridkv.sidecar.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(tiny_checkpoint))
    rng = random.Random(seed)
    # Random ids of a byte-level vocabulary: characters split across ids, bytes that never complete one, and the
    # special ids (skipped) among them.
    streams = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))] for _ in range(4)]
    detokenizers = [IncrementalDetokenizer() for _ in streams]
    texts = [[] for _ in streams]
    for position in range(max(map(len, streams))):
        live = [index for index, ids in enumerate(streams) if position < len(ids)]
        assert detokenize_step(tokenizer, [detokenizers[i] for i in live],
                               [streams[i][position] for i in live]) == [False] * len(live)
        for index in live:
            texts[index].append(detokenizers[index].delta(finished=False))
    for ids, detokenizer, pieces in zip(streams, detokenizers, texts):
        assert pieces == windowed_texts(tokenizer, ids)
        detokenizer.flush(tokenizer)
        assert "".join(pieces) + detokenizer.delta(finished=True) == tokenizer.decode(ids)
