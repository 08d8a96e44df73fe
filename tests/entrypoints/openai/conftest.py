"""Server fixtures: one tiny-model server (behind an API key) for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.entrypoints.openai.remote_server import API_KEY, TINY_MODEL_NAME, RemoteServer


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dirs: dict[str, str]) -> Iterator[RemoteServer]:
    """A tiny llama behind an API key, with a short max_model_len and small blocks; it
    accepts chat templates in requests (test_chat renders with one)."""
    server = RemoteServer(
        tiny_model_dirs["llama"],
        "--served-model-name",
        TINY_MODEL_NAME,
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "1024",
        "--block-size",
        "8",
        "--trust-request-chat-template",
        api_key=API_KEY,
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_client(tiny_server: RemoteServer) -> openai.OpenAI:
    return tiny_server.client()
