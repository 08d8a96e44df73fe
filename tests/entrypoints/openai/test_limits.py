"""Request limits and hostile input over real HTTP (the default limits of the shared
tiny server): each is refused with a clear 4xx and the server keeps serving."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME
from tests.entrypoints.openai.test_errors import assert_error, completion

BODY_LIMIT = 4 * 1024**2  # --max-request-body-size
HEADER_LIMIT = 32 * 1024  # --h11-max-incomplete-event-size
CHAT = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def http(tiny_server):
    with tiny_server.http() as client:
        yield client


def exchange(port: int, request: bytes) -> bytes:
    """Send raw bytes, then read until the server closes the connection (10 s at most)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def status_and_body(response: bytes) -> tuple[int, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def post_json(http, path: str, raw_json: str | bytes):
    return http.post(path, content=raw_json, headers={"Content-Type": "application/json"})


def test_body_over_the_limit_is_413_by_length_and_by_bytes_read(tiny_server, http):
    # Refused on its Content-Length alone: the body is never sent.
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (tiny_server.api_key.encode(), 10 * BODY_LIMIT)
    )
    status, body = status_and_body(exchange(tiny_server.port, request))
    assert status == 413 and "limit" in json.loads(body)["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it is read
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 65536 + 1):
            yield b"a" * 65536
        yield b'"}'

    assert_error(post_json(http, "/v1/completions", chunked()), 413)
    assert http.post("/v1/completions", json=completion()).status_code == 200


def test_too_many_or_too_large_headers(tiny_server, http):
    start = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    many = b"".join(b"X-Header-%d: v\r\n" % i for i in range(150))
    status, body = status_and_body(exchange(tiny_server.port, start + many + b"\r\n"))
    assert status == 431 and json.loads(body)["error"]["type"] == "invalid_request_error"
    large = b"X-Large: " + b"a" * (HEADER_LIMIT + 1024) + b"\r\n"
    status, _ = status_and_body(exchange(tiny_server.port, start + large + b"\r\n"))
    assert status == 431
    # A header block that is still incomplete past the limit: h11 gives up on it (400).
    status, _ = status_and_body(exchange(tiny_server.port, start + large))
    assert status == 400
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 17}, "n"),  # more than --max-n 16
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),  # more than --max-stop-strings 16
        ({"stop": "x" * 513}, "stop"),  # longer than --max-stop-string-length 512
        ({"prompt": ["Hello"] * 100, "n": 16}, "n"),  # 1600 sequences > 128 + 1024
        ({"seed": 2**64}, "seed"),  # integers must fit the engine's 64-bit wire format
        ({"top_k": 2**70}, "top_k"),
        ({"min_tokens": 2**70, "max_tokens": None}, "min_tokens"),
        ({"priority": -(2**63) - 1}, "priority"),
    ],
)
def test_request_limits_are_400(http, fields, param):
    error = assert_error(http.post("/v1/completions", json=completion(**fields)), 400)
    assert error["param"] == param


def test_logprobs_beyond_max_logprobs_are_400(http):
    chat = {**CHAT, "logprobs": True, "top_logprobs": 21}  # --max-logprobs 20
    assert_error(http.post("/v1/chat/completions", json=chat), 400)
    assert_error(http.post("/v1/completions", json=completion(prompt_logprobs=21)), 400)


def test_max_tokens_beyond_the_context_left_names_both_numbers(http):
    prompt = [10 + i % 400 for i in range(1000)]
    error = assert_error(
        http.post("/v1/completions", json=completion(prompt=prompt, max_tokens=100)), 400
    )
    assert "1024" in error["message"] and "1000 in the prompt" in error["message"]
    assert "100 for the completion" in error["message"] and error["param"] == "max_tokens"


@pytest.mark.parametrize(
    "path, raw_json",
    [
        ("/v1/completions", '{"prompt": "\\ud800 lone", "max_tokens": 2}'),
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\udc00"], "max_tokens": 2}'),
        ("/v1/completions", '{"prompt": "hi", "bad_words": ["\\ud83d"], "max_tokens": 2}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("/tokenize", '{"prompt": "\\ud800"}'),
    ],
)
def test_lone_surrogates_are_400(http, path, raw_json):
    assert_error(post_json(http, path, raw_json), 400)


@pytest.mark.parametrize(
    "raw_json",
    [
        "[" * 100_000 + "]" * 100_000,  # nesting deeper than any parser's recursion
        '["a list", "not an object"]',
        '"a string"',
        "42",
        "",
        '{"prompt": "hi", "max_tokens": 1e400}',
        '{"prompt": {"nested": "object"}}',
        '{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "\xff\xfe"}',  # not UTF-8
    ],
)
def test_malformed_bodies_are_400(http, raw_json):
    assert_error(post_json(http, "/v1/completions", raw_json), 400)


def test_no_model_path_or_code_is_taken_from_a_request(http):
    # The model is a served name, never a path to load.
    error = assert_error(http.post("/v1/completions", json=completion(model="/etc/passwd")), 404)
    assert error["param"] == "model"
    # Loader options in a body are ignored, not obeyed.
    body = completion(trust_remote_code=True, download_dir="/tmp", tokenizer="/etc")
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.json()["model"] == TINY_MODEL_NAME
