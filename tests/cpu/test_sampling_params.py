"""SamplingParams validation: each bad value names its field; good values pass and normalise."""

from __future__ import annotations

import pickle

import pytest

from mxserve.api.errors import InvalidRequestError
from mxserve.api.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 99}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        # bool is an int subclass in Python; each integer/number field must still reject it
        ({"top_k": True}, "top_k"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": False}, "min_tokens"),
        ({"logprobs": True}, "logprobs"),
        ({"seed": True}, "seed"),
        ({"temperature": True}, "temperature"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
    ],
)
def test_bad_value_raises_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0},
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
        {"top_k": 0},
        {"top_k": 50, "top_p": 0.01, "min_p": 1.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"max_tokens": 1},
        {"max_tokens": 5, "min_tokens": 5},
        {"logprobs": 0},
        {"logprobs": 20},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 20, "logprobs": 1},
        {"presence_penalty": 2, "frequency_penalty": -2.0, "repetition_penalty": 0.5},
        {"seed": 0},
        {"stop": ["a", "bc"], "stop_token_ids": [0, 7]},
        {"stop": None, "stop_token_ids": None},
    ],
)
def test_good_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("stop", "stop_token_ids"):
            assert getattr(params, name) == value


def test_stop_and_stop_ids_normalise_to_tuples():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    hash(SamplingParams(stop=["a"], stop_token_ids=[1]))  # frozen and hashable


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.1).greedy


@pytest.mark.parametrize("kwargs", [dict(temperature=0.5), dict(logprobs=0),
                                    dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
                                    dict(frequency_penalty=-0.5)])
def test_plain_greedy_is_greedy_with_nothing_touching_the_logits(kwargs):
    """The sampler's argmax-only fast path (min_tokens is checked per request there)."""
    assert SamplingParams(temperature=0, min_tokens=3, stop=["x"]).plain_greedy
    params = SamplingParams(**{"temperature": 0, **kwargs})
    assert not params.plain_greedy
    copy = pickle.loads(pickle.dumps(params))  # cached on the instance, still equal and right
    assert copy == params and not copy.plain_greedy
