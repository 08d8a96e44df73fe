"""SamplingParams: vLLM's defaults, clear errors for bad values, msgspec round trip."""

from __future__ import annotations

import msgspec
import pytest

from tokenserve import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tokenserve.core.request import Request
from tokenserve.messages.engine_core import make_encoder, make_request_decoder


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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), r"exactly one of json, json_object, regex, choice or grammar; got none"),
        (dict(json_object=False), r"got none"),
        (dict(regex="a", choice=["a"]), r"exactly one .* got regex, choice"),
        (dict(json="{not json"), r"structured_outputs.json is not valid JSON"),
        (dict(json="[1, 2]"), r"structured_outputs.json must be a JSON schema \(an object\)"),
        (dict(json=3), r"structured_outputs.json must be a JSON schema"),
        (dict(regex=""), r"structured_outputs.regex must be a non-empty string"),
        (dict(grammar=5), r"structured_outputs.grammar must be a non-empty string"),
        (dict(choice=[]), r"structured_outputs.choice must be a non-empty list"),
        (dict(choice=["a", ""]), r"structured_outputs.choice must be a non-empty list"),
        (dict(regex="a", enforce_after_token_ids=[]), r"enforce_after_token_ids must be None"),
    ],
)
def test_structured_outputs_need_exactly_one_valid_kind(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_from_a_dict():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert params.structured_outputs.kind == "choice"
    with pytest.raises(ValueError, match="structured_outputs: .*unexpected keyword"):
        SamplingParams(structured_outputs={"jsn": {}})


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(json='{"type": "string"}', disable_any_whitespace=True),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d+", enforce_after_token_ids=[7, 8]),
        StructuredOutputsParams(choice=["x", "y"]),
        StructuredOutputsParams(grammar='root ::= "a"'),
    ],
)
def test_structured_outputs_cross_to_the_engine_core(structured):
    params = SamplingParams(structured_outputs=structured)
    request = Request("r", [1, 2], params, eos_token_id=0)
    wire = make_encoder().encode(request.to_engine_core_request())
    decoded = Request.from_engine_core_request(make_request_decoder().decode(wire))
    assert decoded.sampling_params == params
