"""The output processor over scripted engine-core outputs: incremental text, stop strings,
output kinds, special tokens, n > 1 merging."""

from __future__ import annotations

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenserve.engine.output_processor import OutputProcessor
from tokenserve.messages.engine_core import EngineCoreOutput
from tokenserve.sampling_params import RequestOutputKind, SamplingParams

EMOJI_CJK_TEXT = "Hi 😀 你好, 🎉 世界! café ñ 🇫🇷 end"
ENGLISH_TEXT = "The capital of France is Paris, and the capital of Italy is Rome."
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def run(tokenizer, token_ids, params, finish_reason="length", stop_reason=None, request_id="r"):
    """Feed `token_ids` one step at a time; returns (RequestOutputs, steps that asked to abort)."""
    processor = OutputProcessor(tokenizer)
    processor.add_request(request_id, None, PROMPT, params, arrival_time=0.0)
    outputs, aborts = [], []
    for step, token_id in enumerate(token_ids):
        last = step == len(token_ids) - 1
        processed = processor.process_outputs(
            [
                EngineCoreOutput(
                    request_id,
                    [token_id],
                    finish_reason=finish_reason if last else None,
                    stop_reason=stop_reason if last else None,
                )
            ]
        )
        outputs.extend(processed.request_outputs)
        if processed.reqs_to_abort:
            aborts.append(step)
            assert processed.reqs_to_abort == [request_id]
            break  # the engine would drop the request here
    assert not processor.has_unfinished_requests()
    return outputs, aborts


def test_emoji_and_cjk_deltas_join_to_the_text(tokenizer):
    token_ids = tokenizer.encode(EMOJI_CJK_TEXT)
    # The test means something only if some tokens are pieces of a character.
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    outputs, _ = run(tokenizer, token_ids, SamplingParams(output_kind=RequestOutputKind.DELTA))
    deltas = [o.outputs[0].text for o in outputs]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == EMOJI_CJK_TEXT
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(token_ids)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 499), min_size=1, max_size=8),
    token_ids=st.lists(st.integers(0, 499), min_size=1, max_size=24),
    skip_special_tokens=st.booleans(),
)
def test_deltas_join_to_the_full_decode(tokenizer, prompt, token_ids, skip_special_tokens):
    """Any token sequence, valid UTF-8 or not: the deltas add up to the tokenizer's decode,
    less the incomplete character a finish may cut (its trailing "\ufffd")."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(
        skip_special_tokens=skip_special_tokens, output_kind=RequestOutputKind.DELTA
    )
    processor.add_request("r", None, prompt, params, arrival_time=0.0)
    text = ""
    for step, token_id in enumerate(token_ids):
        finish_reason = "length" if step == len(token_ids) - 1 else None
        processed = processor.process_outputs(
            [EngineCoreOutput("r", [token_id], finish_reason=finish_reason)]
        )
        text += processed.request_outputs[0].outputs[0].text
    decoded = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert text == decoded.rstrip("\ufffd")


CUT_TEXT = "Repeat exactly: 🎉🚀 naïve café 日本語 😀"


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_a_character_cut_by_max_tokens_is_dropped_not_replaced(tokenizer, kind):
    """Issue 25: max_tokens ending inside a multi-byte character gave a final "\ufffd"."""
    token_ids = tokenizer.encode(CUT_TEXT)
    cuts = [
        n for n in range(1, len(token_ids)) if tokenizer.decode(token_ids[:n]).endswith("\ufffd")
    ]
    assert cuts  # the text has characters that span tokens
    for n in range(1, len(token_ids) + 1):
        outputs, _ = run(tokenizer, token_ids[:n], SamplingParams(output_kind=kind))
        text = "".join(o.outputs[0].text for o in outputs)
        assert "\ufffd" not in text, n
        # Every complete character is kept: only the cut one is missing.
        assert text == tokenizer.decode(token_ids[:n]).rstrip("\ufffd"), n
        assert CUT_TEXT.startswith(text)


def test_cumulative_and_final_only(tokenizer):
    token_ids = tokenizer.encode(EMOJI_CJK_TEXT)
    outputs, _ = run(tokenizer, token_ids, SamplingParams(output_kind=RequestOutputKind.CUMULATIVE))
    assert len(outputs) == len(token_ids)
    for output in outputs:
        assert EMOJI_CJK_TEXT.startswith(output.outputs[0].text)
        assert "\ufffd" not in output.outputs[0].text
    assert outputs[-1].outputs[0].text == EMOJI_CJK_TEXT
    assert outputs[-1].outputs[0].token_ids == token_ids

    outputs, _ = run(tokenizer, token_ids, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].text == EMOJI_CJK_TEXT


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tokenizer, include):
    token_ids = tokenizer.encode(ENGLISH_TEXT)
    stop = "France is"  # five tokens: " ", "Fr", "an", "ce", " is"
    params = SamplingParams(
        stop=["nothing like this", stop],
        include_stop_str_in_output=include,
        output_kind=RequestOutputKind.DELTA,
    )
    outputs, aborts = run(tokenizer, token_ids, params)
    expected = "The capital of France is" if include else "The capital of "
    assert "".join(o.outputs[0].text for o in outputs) == expected
    final = outputs[-1]
    assert final.finished
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    # It stopped at the token that completed the stop string.
    assert aborts == [tokenizer.convert_ids_to_tokens(token_ids).index("Ġis")]


def test_text_is_held_back_only_while_a_stop_string_may_complete(tokenizer):
    token_ids = tokenizer.encode(ENGLISH_TEXT)
    stop = "Paris!"  # never completes: "Paris," follows
    params = SamplingParams(stop=[stop], output_kind=RequestOutputKind.CUMULATIVE)
    outputs, aborts = run(tokenizer, token_ids, params)
    assert not aborts
    for step, output in enumerate(outputs[:-1]):
        decoded = tokenizer.decode(token_ids[: step + 1])
        text = output.outputs[0].text
        held = decoded[len(text) :]
        assert decoded.startswith(text)
        assert len(held) <= len(stop) - 1
        assert held == "" or stop.startswith(held)
        if not any(decoded.endswith(stop[:n]) for n in range(1, len(stop))):
            assert held == ""
    assert outputs[-1].outputs[0].text == ENGLISH_TEXT


def test_stop_strings_wait_for_min_tokens(tokenizer):
    token_ids = tokenizer.encode(ENGLISH_TEXT)
    params = SamplingParams(
        stop=["capital"], min_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY
    )
    outputs, _ = run(tokenizer, token_ids, params)
    # The first "capital" (token 2) comes before min_tokens; the second one stops.
    assert outputs[-1].outputs[0].text == "The capital of France is Paris, and the "


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text(tokenizer, include):
    token_ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    outputs, _ = run(tokenizer, token_ids, params, finish_reason="stop")
    completion = outputs[-1].outputs[0]
    assert completion.text == "Hi there" + ("<|endoftext|>" if include else "")
    assert completion.token_ids == token_ids


@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens(tokenizer, spaces):
    token_ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|><|im_start|>")
    kept = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    outputs, _ = run(tokenizer, token_ids, kept)
    assert outputs[-1].outputs[0].text == "<|im_start|>assistant\nHi<|im_end|><|im_start|>"
    outputs, _ = run(tokenizer, token_ids, SamplingParams(spaces_between_special_tokens=spaces))
    assert outputs[-1].outputs[0].text == "assistant\nHi"


def test_n_children_merge_into_one_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=3, output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("p", None, PROMPT, params, arrival_time=0.0)
    with pytest.raises(ValueError, match="already in use"):
        processor.add_request("p", None, PROMPT, params, arrival_time=0.0)
    texts = {"0_p": "The", "1_p": " capital", "2_p": "Rome"}
    results = []
    for child_id, text in texts.items():
        token_ids = tokenizer.encode(text)
        assert len(token_ids) == 1
        results += processor.process_outputs(
            [EngineCoreOutput(child_id, token_ids, finish_reason="length", num_cached_tokens=16)]
        ).request_outputs
    assert len(results) == 1  # FINAL_ONLY: once, when every child is done
    [output] = results
    assert output.request_id == "p" and output.finished
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert [c.text for c in output.outputs] == list(texts.values())
    assert output.num_cached_tokens == 16

    processor.add_request("q", None, PROMPT, params, arrival_time=0.0)
    assert processor.abort_requests(["q"]) == ["0_q", "1_q", "2_q"]
    assert not processor.has_unfinished_requests()
