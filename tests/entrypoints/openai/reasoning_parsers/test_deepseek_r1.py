"""The deepseek_r1 reasoning parser (vLLM's reading of <think>...</think>), whole and streamed."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.parser_streams import every_cut, token_pieces
from tokenserve.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
)


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>The user wants a city.</think>Paris", "The user wants a city.", "Paris"),
        # The template put <think> in the prompt: the output starts inside the reasoning.
        ("The user wants a city.</think>\n\nParis", "The user wants a city.", "\n\nParis"),
        # Cut off while thinking: all of it is reasoning.
        ("<think>Let me think about", "Let me think about", None),
        ("No markers at all.", "No markers at all.", None),
        ("<think>Done.</think>", "Done.", None),
        ("</think>Paris", None, "Paris"),
        ("a</think>b</think>c", "a", "b</think>c"),
        ("", None, None),
    ],
)
def test_reasoning_and_content(text, reasoning, content):
    assert DeepSeekR1ReasoningParser().extract(text) == (reasoning, content)


def test_after_a_prompt_that_closed_the_reasoning_all_is_content():
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert DeepSeekR1ReasoningParser.prompt_ends_reasoning(prompt)
    assert not DeepSeekR1ReasoningParser.prompt_ends_reasoning("<|im_start|>assistant\n<think>\n")
    assert not DeepSeekR1ReasoningParser.prompt_ends_reasoning("<think>a</think>b<|im_start|>")
    parser = DeepSeekR1ReasoningParser(reasoning_ended=True)
    assert parser.extract("Paris</think>x") == (None, "Paris</think>x")


TEXT = "<think>Paris is in France; a <b> tag is not a marker.</think>The answer: Paris."


def test_streamed_in_pieces_of_any_size_equals_whole():
    for cut in every_cut(TEXT):
        parser = DeepSeekR1ReasoningParser()
        reasoning = content = ""
        for chunk in cut:
            more_reasoning, more_content = parser.feed(chunk)
            reasoning, content = reasoning + more_reasoning, content + more_content
        more_reasoning, more_content = parser.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        assert (reasoning, content) == (
            "Paris is in France; a <b> tag is not a marker.",
            "The answer: Paris.",
        ), len(cut[0])


def test_streamed_by_tokens_never_leaks_a_marker(tiny_tokenizer):
    parser = DeepSeekR1ReasoningParser()
    deltas = [parser.feed(chunk) for chunk in token_pieces(tiny_tokenizer, TEXT)]
    deltas.append(parser.finish())
    assert not any("<" in reasoning and "think" in reasoning for reasoning, _ in deltas)
    assert "".join(r for r, _ in deltas) == "Paris is in France; a <b> tag is not a marker."
    assert "".join(c for _, c in deltas) == "The answer: Paris."
    assert sum(1 for r, _ in deltas if r) > 5  # the reasoning streamed, not all at the end


def test_a_marker_split_across_deltas_is_held_back():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("I think </th") == ("I think ", "")
    assert parser.feed("ink>Yes") == ("", "Yes")
    assert parser.feed(" indeed") == ("", " indeed")


def test_qwen3_is_read_the_same_way():
    assert REASONING_PARSERS["qwen3"]().extract("<think>a</think>b") == ("a", "b")
