"""Server fixtures for the whole session: a tiny-model server (behind an API key), and one
serving the default model (SmolLM2), started only when a test asks for it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import transformers

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


@pytest.fixture(scope="session")
def default_server(default_model_path: str) -> Iterator[RemoteServer]:
    """`tokenserve serve` with no model argument: the default model, SmolLM2-135M-Instruct."""
    server = RemoteServer(None, "--kv-cache-memory", "256MiB", "--max-model-len", "2048")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: str) -> Any:
    """The tiny byte-level BPE, to cut parser inputs into token-sized pieces."""
    return transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
