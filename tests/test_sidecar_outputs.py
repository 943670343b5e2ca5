"""What the engine hands the server crosses a pipe every step: a request output survives pickling with every field,
whatever it holds."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from hybridkv.sidecar.core.outputs import RequestOutput, RequestTimings, TokenLogprobs


def _distinct_output() -> RequestOutput:
    """Every field set, and no two alike, so a field pickled into another's place shows."""
    return RequestOutput(request_id="cmpl-7", new_token_ids=[11, 12], text_delta="hi", finished=True,
                         finish_reason="length", prompt_tokens=300, completion_tokens=40, cached_tokens=16,
                         logprobs=[TokenLogprobs(-0.5, ((11, -0.5), (3, -1.5)))],
                         timings=RequestTimings(queue_s=0.25, prefill_s=0.125, decode_s=2.0),
                         time_to_first_token_s=0.375)


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_a_request_output_round_trips_with_every_field(protocol):
    output = _distinct_output()
    loaded = pickle.loads(pickle.dumps(output, protocol=protocol))
    assert loaded == output
    assert [getattr(loaded, f.name) for f in dataclasses.fields(RequestOutput)] == \
        [getattr(output, f.name) for f in dataclasses.fields(RequestOutput)]


def test_the_pickled_form_names_every_field_in_order():
    """A field added to the dataclass and not to its reduction would be dropped or shifted on the way."""
    cls, args = _distinct_output().__reduce__()
    assert cls is RequestOutput
    assert args == tuple(getattr(_distinct_output(), f.name) for f in dataclasses.fields(RequestOutput))
