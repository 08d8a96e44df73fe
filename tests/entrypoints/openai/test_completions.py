"""/v1/completions through the official openai client, against a real server (tiny llama)."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME, RemoteServer, stop_string_inside

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def complete(client: openai.OpenAI, prompt, **kwargs):
    return client.completions.create(model=TINY_MODEL_NAME, prompt=prompt, **kwargs)


def count_tokens(server: RemoteServer, text: str) -> int:
    with server.http() as http:
        return http.post("/tokenize", json={"prompt": text}).json()["count"]


def test_models_lists_the_served_name(tiny_client):
    assert [model.id for model in tiny_client.models.list().data] == [TINY_MODEL_NAME]


def test_models_retrieve_one_by_id(tiny_server, tiny_client):
    [listed] = tiny_client.models.list().data
    model = tiny_client.models.retrieve(TINY_MODEL_NAME)
    assert model.id == TINY_MODEL_NAME and model.object == "model"
    assert model.model_dump() == listed.model_dump() | {"created": model.created}
    with pytest.raises(openai.NotFoundError) as caught:
        tiny_client.models.retrieve("org/no-such-model")
    assert caught.value.body["code"] == "model_not_found"
    with tiny_server.http() as http:
        error = http.get("/v1/models/org/no-such-model").json()["error"]
    assert (
        set(error) == {"message", "type", "param", "code"}
        and "org/no-such-model" in error["message"]
    )


def test_completion_counts_tokens_and_stops_at_max_tokens(tiny_server, tiny_client):
    prompt = "The capital of France is"
    response = complete(tiny_client, prompt, max_tokens=8, **GREEDY)
    [choice] = response.choices
    assert choice.index == 0 and choice.text
    assert choice.finish_reason == "length"
    assert response.model == TINY_MODEL_NAME
    assert response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens == count_tokens(tiny_server, prompt)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8


def test_streaming_equals_non_streaming_and_reports_usage(tiny_client):
    prompt = "Once upon a time there was"
    expected = complete(tiny_client, prompt, max_tokens=12, **GREEDY)
    chunks = list(
        complete(
            tiny_client,
            prompt,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == expected.choices[0].text
    finish_reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finish_reasons == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_n_returns_n_choices(tiny_client):
    response = complete(
        tiny_client,
        "Hello world",
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 12
    stream = complete(
        tiny_client,
        "Hello world",
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {choice.index: choice.text for choice in response.choices}


def test_seed_makes_sampling_reproducible(tiny_client):
    first, second = (
        complete(
            tiny_client,
            "A journey of",
            max_tokens=10,
            temperature=1.0,
            seed=42,
            extra_body={"ignore_eos": True},
        )
        for _ in range(2)
    )
    assert first.choices[0].text == second.choices[0].text


def test_logprobs(tiny_client):
    response = complete(tiny_client, "Water boils at", max_tokens=5, logprobs=3, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for token, token_logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs
    ):
        assert token_logprob <= 0.0
        # The chosen token and the 3 likeliest (fewer keys when two tokens share a text).
        assert 1 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert top[token] == pytest.approx(token_logprob) == pytest.approx(max(top.values()))
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_prepends_the_prompt_and_its_logprobs(tiny_client):
    prompt = "Hello, world!"
    response = complete(tiny_client, prompt, max_tokens=3, echo=True, logprobs=1, **GREEDY)
    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    num_tokens = response.usage.prompt_tokens + 3
    assert len(choice.logprobs.tokens) == num_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])


def test_streamed_echo_starts_every_choice_with_the_prompt(tiny_client):
    prompt = "Hello, world!"
    texts = {0: "", 1: ""}
    for chunk in complete(
        tiny_client,
        prompt,
        max_tokens=3,
        n=2,
        echo=True,
        stream=True,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert all(text.startswith(prompt) and len(text) > len(prompt) for text in texts.values())


def test_stop_string_ends_the_completion(tiny_client):
    prompt = "The quick brown fox"
    full = complete(tiny_client, prompt, max_tokens=24, **GREEDY).choices[0].text
    stop = stop_string_inside(full)
    cut = full.index(stop)
    response = complete(tiny_client, prompt, max_tokens=24, stop=[stop], **GREEDY)
    choice = response.choices[0]
    assert choice.text == full[:cut]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_several_prompts_give_one_choice_each(tiny_client):
    response = complete(tiny_client, ["Hello", "Goodbye"], max_tokens=4, **GREEDY)
    assert [choice.index for choice in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 8
    by_ids = complete(tiny_client, [[5, 6, 7, 8], [9, 10]], max_tokens=4, **GREEDY)
    assert [choice.index for choice in by_ids.choices] == [0, 1]
    assert by_ids.usage.prompt_tokens == 6


def test_repeated_prompt_reports_cached_tokens(tiny_client):
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 8
    first = complete(tiny_client, prompt, max_tokens=2, **GREEDY)
    second = complete(tiny_client, prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_vllm_sampling_extras_are_honoured(tiny_server, tiny_client):
    forced_token = 300
    response = complete(
        tiny_client,
        "Hello",
        max_tokens=5,
        temperature=0.0,
        logit_bias={str(forced_token): 100},
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="someone",
        extra_body={
            "ignore_eos": True,
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "cache_salt": "salt",
        },
        logprobs=0,
    )
    choice = response.choices[0]
    assert response.usage.completion_tokens == 5
    # logit_bias +100 makes that token the greedy choice at every position.
    assert len(set(choice.logprobs.tokens)) == 1
    with tiny_server.http() as http:
        detokenized = http.post("/detokenize", json={"tokens": [forced_token]}).json()["prompt"]
    assert choice.logprobs.tokens[0] == detokenized
