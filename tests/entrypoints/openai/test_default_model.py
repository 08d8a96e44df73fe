"""`tokenserve serve` with no model argument serves the default model, SmolLM2-135M-Instruct
(the session's `default_server`, conftest.py)."""

from __future__ import annotations

DEFAULT_NAME = "SmolLM2-135M-Instruct"


def test_chat_answers_paris(default_server):
    client = default_server.client()
    assert [model.id for model in client.models.list().data] == [DEFAULT_NAME]
    response = client.chat.completions.create(
        model=DEFAULT_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0.0,
        max_tokens=32,
    )
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 32


def test_streamed_chat_answers_paris(default_server):
    stream = default_server.client().chat.completions.create(
        model=DEFAULT_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0.0,
        max_tokens=32,
        stream=True,
    )
    content = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in content
