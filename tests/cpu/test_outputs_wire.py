"""The worker -> router delta encoding (api/outputs.encode_output / decode_output): every field
comes back equal, logprob maps with their int keys in their order (the sampled token first),
a migrating request's ResumeState whole."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from mxserve.api.outputs import ResumeState, StepOutput, decode_output, encode_output, merge_outputs

ids = st.lists(st.integers(0, 2**31 - 1), max_size=20)
logprob = st.floats(allow_nan=False, max_value=0.0)  # -inf included
top = st.dictionaries(st.integers(0, 300_000), logprob, max_size=5)
counts = st.integers(0, 2**40)
resume = st.builds(ResumeState, st.text(max_size=12), st.none() | st.text(max_size=30), counts,
                   ids, st.none() | st.binary(max_size=64), counts, counts, counts, counts,
                   st.booleans())
outputs = st.builds(
    StepOutput, st.text(max_size=40), ids, st.none() | st.lists(top, max_size=8), st.booleans(),
    st.none() | st.sampled_from(["stop", "length", "abort", "migrate"]), counts, counts, counts,
    counts, counts, counts, st.none() | resume, st.none() | st.lists(st.none() | top, max_size=6))


@settings(max_examples=300, deadline=None)
@given(outputs)
def test_a_delta_comes_back_equal(out):
    data = encode_output(out)
    assert isinstance(data, bytes)
    back = decode_output(data)
    assert back == out
    for got, sent in zip(back.new_logprobs or [], out.new_logprobs or []):
        assert list(got) == list(sent)  # order kept: the sampled token's entry first
    if out.resume is not None:
        assert isinstance(back.resume, ResumeState)


def test_minus_infinity_and_order_survive():
    out = StepOutput("r", [7, 3], [{7: -0.5, 1: -1.25}, {3: -math.inf, 9: -2.0}], True,
                     "stop", 4, 0, 2, prompt_logprobs=[None, {5: -0.1, 2: -3.0}])
    back = decode_output(encode_output(out))
    assert back == out and [list(d) for d in back.new_logprobs] == [[7, 1], [3, 9]]
    assert back.new_logprobs[1][3] == -math.inf


@settings(max_examples=200, deadline=None)
@given(st.lists(outputs, min_size=1, max_size=6))
def test_merged_deltas_join_tokens_and_logprobs_and_keep_the_last_state(outs):
    """What a consumer took late (or a direct stream held) goes on as one delta: every token
    in order, the logprobs of those that carry them in order, the first prompt logprobs, and
    the rest as the last delta says."""
    merged = merge_outputs(outs)
    last = outs[-1]
    assert merged.new_token_ids == [t for o in outs for t in o.new_token_ids]
    with_lp = [lp for o in outs if o.new_logprobs is not None for lp in o.new_logprobs]
    assert merged.new_logprobs == (None if all(o.new_logprobs is None for o in outs)
                                   else with_lp)
    plp = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert merged.prompt_logprobs == (plp[0] if plp else None)
    for field in ("request_id", "finished", "finish_reason", "num_prompt_tokens",
                  "num_cached_tokens", "num_output_tokens", "num_drafts", "num_draft_tokens",
                  "num_accepted_tokens", "resume"):
        assert getattr(merged, field) == getattr(last, field), field
