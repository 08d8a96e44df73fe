"""Error cases over raw HTTP: status codes and OpenAI's error body shape."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.remote_server import API_KEY, TINY_MODEL_NAME

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]
    return body["error"]


def completion(**fields) -> dict:
    return {"model": TINY_MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


@pytest.fixture
def http(tiny_server):
    with tiny_server.http() as client:
        yield client


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/models", None),
        ("/v1/completions", completion()),
        (
            "/v1/chat/completions",
            {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("/tokenize", {"prompt": "hi"}),
        ("/version", None),
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {API_KEY}"])
def test_missing_or_wrong_api_key_is_401(tiny_server, path, body, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    with httpx.Client(base_url=tiny_server.url, headers=headers, timeout=30) as client:
        response = client.get(path) if body is None else client.post(path, json=body)
    assert_error(response, 401)


def test_health_and_metrics_need_no_key(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "tokenserve:" in metrics.text


def test_right_key_is_accepted(http):
    assert http.get("/version").json()["version"]
    assert http.get("/v1/models").status_code == 200


def test_unknown_model_is_404(http):
    error = assert_error(http.post("/v1/completions", json=completion(model="gpt-17")), 404)
    assert "gpt-17" in error["message"] and error["param"] == "model"
    chat = {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 404)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -1.0}, None),
        ({"top_p": 0.0}, None),
        ({"n": 0}, None),
        ({"max_tokens": 0}, None),
        ({"presence_penalty": 5.0}, None),
        ({"logprobs": 50}, None),  # more than --max-logprobs (20)
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"prompt": None}, "prompt"),
        ({"logit_bias": {"999999": 1.0}}, None),
        ({"stop_token_ids": [-3]}, None),
        ({"stream_options": {"include_usage": True}}, None),  # without stream
    ],
)
def test_invalid_parameters_are_400(http, fields, param):
    error = assert_error(http.post("/v1/completions", json=completion(**fields)), 400)
    if param is not None:
        assert error["param"] == param


def test_invalid_parameters_are_400_when_streaming_too(http):
    response = http.post("/v1/completions", json=completion(temperature=-1.0, stream=True))
    assert_error(response, 400)


def test_missing_field_and_bad_json_are_400(http):
    assert_error(http.post("/v1/completions", json={"model": TINY_MODEL_NAME}), 400)
    response = http.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400)


def test_prompt_longer_than_the_model_allows_is_400(http):
    long_prompt = [10 + i % 400 for i in range(1100)]  # max_model_len is 1024
    error = assert_error(http.post("/v1/completions", json=completion(prompt=long_prompt)), 400)
    assert "maximum context length" in error["message"]
    # Fits alone, but not with the requested completion.
    error = assert_error(
        http.post("/v1/completions", json=completion(prompt=long_prompt[:1000], max_tokens=100)),
        400,
    )
    assert "1024" in error["message"]
    long_chat = {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": "hello " * 1100}],
    }
    assert_error(http.post("/v1/chat/completions", json=long_chat), 400)


def test_invalid_chat_requests_are_400(http):
    both = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
        "add_generation_prompt": True,
        "continue_final_message": True,
    }
    assert_error(http.post("/v1/chat/completions", json=both), 400)
    image = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]
    }
    assert_error(http.post("/v1/chat/completions", json=image), 400)
    assert_error(http.post("/v1/chat/completions", json={"messages": []}), 400)
    assert_error(
        http.post("/v1/chat/completions", json={"messages": [{"content": "no role"}]}), 400
    )
    bad_template = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% for %}"}
    assert_error(http.post("/v1/chat/completions", json=bad_template), 400)


def test_token_ids_outside_the_vocabulary_are_400(http):
    assert_error(http.post("/v1/completions", json=completion(prompt=[1, 2, 10**6])), 400)


def test_invalid_tokenize_requests_are_400(http):
    assert_error(http.post("/tokenize", json={}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400)


def test_server_keeps_serving_after_errors(http):
    response = http.post("/v1/completions", json=completion())
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1
