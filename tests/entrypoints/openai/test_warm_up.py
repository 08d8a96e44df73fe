"""The chat path's warm-up while the engine core loads: the first request finds the chat
template compiled (unit, on the session's tiny tokenizer; no engine behind it)."""

from __future__ import annotations

import copy

import jinja2
import pytest

from tests.entrypoints.openai.test_structured_outputs import serving_chat
from tokenserve.entrypoints.chat_utils import detect_content_format
from tokenserve.entrypoints.openai.protocol import ChatCompletionRequest

REQUEST = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "2 + 2?"}])


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """Every jinja2 template compiled from here on (the caches of compiled chat templates
    emptied first)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    _compile_jinja_template.cache_clear()
    detect_content_format.cache_clear()
    compiled: list[str] = []
    original = jinja2.Environment.compile

    def counting(self, source, *args, **kwargs):
        compiled.append(source)
        return original(self, source, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    return compiled


def test_the_first_request_finds_the_template_compiled(tiny_tokenizer, compiles):
    serving = serving_chat(tiny_tokenizer)
    serving.warm_up()
    assert compiles, "the warm-up rendered no template"
    warmed = len(compiles)
    prepared = serving.prepare(REQUEST)
    assert len(compiles) == warmed  # nothing compiled for the request itself
    assert prepared.token_ids == tiny_tokenizer.encode(prepared.text, add_special_tokens=False)


def test_without_a_template_the_warm_up_leaves_the_error_to_the_request(tiny_tokenizer, compiles):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = None
    serving = serving_chat(tokenizer)
    serving.warm_up()  # nothing to render: no error at start
    assert not compiles
    with pytest.raises(ValueError, match="no chat template"):
        serving.prepare(REQUEST)
