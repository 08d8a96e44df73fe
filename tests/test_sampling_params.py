"""SamplingParams: vLLM's defaults, clear errors for bad values, msgspec round trip."""

from __future__ import annotations

import msgspec
import pytest

from tokenserve import RequestOutputKind, SamplingParams


def test_defaults_follow_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert params.stop == [] and params.stop_token_ids == []
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert not params.include_stop_str_in_output and not params.ignore_eos
    assert (
        params.logit_bias is None and params.allowed_token_ids is None and params.bad_words is None
    )
    assert params.output_kind == RequestOutputKind.CUMULATIVE


def test_normalizes_inputs():
    params = SamplingParams(stop="###", top_k=-1, logit_bias={"7": 500, 3: -1})
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert params.logit_bias == {7: 100.0, 3: -1.0}  # clamped to [-100, 100] as vLLM does


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n=0), r"n must be at least 1"),
        (dict(temperature=-0.1), r"temperature must be non-negative"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), r"top_k must be -1 \(disable\), 0 \(disable\) or at least 1"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be greater than 0"),
        (dict(max_tokens=0), r"max_tokens must be at least 1"),
        (dict(min_tokens=-1), r"min_tokens must be non-negative"),
        (dict(min_tokens=5, max_tokens=4), r"min_tokens must be less than or equal to max_tokens"),
        (dict(logprobs=-1), r"logprobs must be None or a non-negative integer"),
        (dict(prompt_logprobs=-1), r"prompt_logprobs must be None or a non-negative integer"),
        (dict(stop=[""]), r"stop must be a string or a list of non-empty strings"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids must be non-negative integer token ids"),
        (dict(allowed_token_ids=[]), r"allowed_token_ids must be None or a non-empty list"),
        (dict(logit_bias={"x": 1}), r"logit_bias must map token ids to numbers"),
        (dict(bad_words=[" "]), r"bad_words must be a list of non-empty strings"),
        (dict(seed=1.5), r"seed must be an integer"),
    ],
)
def test_invalid_values_name_the_parameter_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_msgspec_round_trip():
    params = SamplingParams(
        n=2,
        stop=["a", "bc"],
        logit_bias={5: 1.5},
        allowed_token_ids=[1, 2],
        bad_words=["x"],
        logprobs=3,
        output_kind=RequestOutputKind.DELTA,
        bad_words_token_ids=[[1, 2]],
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
