"""Image URLs in chat requests to a real `tokenserve serve` (the shared tiny server, default
media settings): each refusal is a 400 naming why, nothing is fetched from a refused
address, and the server keeps serving."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME
from tests.multimodal.media_server import MediaServer


@pytest.fixture(scope="module")
def media_server() -> Iterator[MediaServer]:
    server = MediaServer()
    yield server
    server.stop()


def image_chat(url: str, stream: bool = False) -> dict:
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "stream": stream,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_url_on_loopback_is_a_400_and_never_fetched(tiny_server, media_server, stream):
    with tiny_server.http() as http:
        response = http.post(
            "/v1/chat/completions", json=image_chat(media_server.url("/image.png"), stream)
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        assert "127.0.0.1" in error["message"] and "loopback" in error["message"]
        assert "--allowed-media-networks" in error["message"]
        assert media_server.requests == []

        text_chat = {
            "model": TINY_MODEL_NAME,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 2,
        }
        answer = http.post("/v1/chat/completions", json=text_chat)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "image/*"),
        ("data:image/png;base64," + base64.b64encode(b"hello").decode(), "not an image"),
        ("file:///etc/passwd", "--allowed-local-media-path"),
        ("gopher://example.com/1", "scheme 'gopher'"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ],
)
def test_each_refusal_is_a_400_naming_why(tiny_server, url, named):
    with tiny_server.http() as http:
        response = http.post("/v1/chat/completions", json=image_chat(url))
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_too_many_images_are_refused_before_any_fetch(tiny_server, media_server):
    """Without --limit-mm-per-prompt a prompt may hold 16 images."""
    body = image_chat(media_server.url("/image.png"))
    part = body["messages"][0]["content"][1]
    body["messages"][0]["content"] += [part] * 16
    with tiny_server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "At most 16 image(s)" in response.json()["error"]["message"]
    assert media_server.requests == []


def test_unsupported_parts_and_tokenize_with_images_are_400(tiny_server):
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    body = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": [audio]}]}
    with tiny_server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert "'input_audio' is not supported" in response.json()["error"]["message"]
        tokenize = http.post("/tokenize", json=image_chat("https://example.com/a.png"))
        assert tokenize.status_code == 400
        assert "/v1/chat/completions only" in tokenize.json()["error"]["message"]


def test_media_flags_reach_the_connector_and_the_chat(tmp_path):
    from tokenserve.entrypoints.cli import build_parser
    from tokenserve.entrypoints.openai.api_server import chat_content_from, media_connector_from

    args = build_parser().parse_args(
        ["serve", "--allowed-media-domains", "Images.Example.", "--allowed-media-networks",
         "10.1.0.0/16", "--allowed-local-media-path", str(tmp_path), "--media-fetch-timeout",
         "2.5", "--max-media-bytes", "1MiB", "--max-image-pixels", "1000",
         "--max-media-redirects", "1", "--chat-template-content-format", "openai"]
    )
    config = media_connector_from(args).config
    assert config.allowed_media_domains == ("images.example",)
    assert config.allowed_media_networks == ("10.1.0.0/16",)
    assert config.allowed_local_media_path == str(tmp_path.resolve())
    assert (config.media_fetch_timeout, config.max_media_bytes) == (2.5, 1024**2)
    assert (config.max_image_pixels, config.max_media_redirects) == (1000, 1)
    assert chat_content_from(args).content_format == "openai"
    assert chat_content_from(args).max_images_per_prompt == 16  # without --limit-mm-per-prompt
    # --limit-mm-per-prompt (an engine flag) bounds the images a prompt may fetch.
    args.limit_mm_per_prompt = '{"image": 2}'
    assert chat_content_from(args).max_images_per_prompt == 2
