"""LoRA adapters over HTTP with the `openai` client: adapters registered at start (both
--lora-modules forms) are listed with their parent and picked by `model`, their outputs
equal peft's; /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters
behind the API key; bad adapters are 400, unknown ones 404, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import transformers

from tests.entrypoints.openai.remote_server import API_KEY, TINY_MODEL_NAME, RemoteServer
from tests.lora.peft_adapters import peft_greedy

MAX_TOKENS = 8


def _final_text(tokenizer, tokens: list[int]) -> str:
    """The text a finished request reads: a character cut by max_tokens is dropped."""
    return tokenizer.decode(tokens).rstrip("\ufffd")


@pytest.fixture(scope="module")
def lora_server(lora_base, lora_adapters) -> Iterator[RemoteServer]:
    server = RemoteServer(
        lora_base,
        "--served-model-name", TINY_MODEL_NAME,
        "--kv-cache-memory", "64MiB",
        "--max-model-len", "512",
        "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
        "--lora-modules", f"a0={lora_adapters['a0']}",
        json.dumps({"name": "a1", "path": lora_adapters["a1"], "base_model_name": "tiny-parent"}),
        "--allow-runtime-lora-updating",
        api_key=API_KEY,
    )
    yield server
    server.stop()


def _completion_text(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return completion.choices[0].text


def test_adapters_are_listed_picked_by_model_and_equal_peft(
    lora_server, lora_base, lora_adapters, lora_prompts
):
    client = lora_server.client()
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {TINY_MODEL_NAME, "a0", "a1"}
    assert cards["a0"].parent == TINY_MODEL_NAME and cards["a0"].root == lora_adapters["a0"]
    assert cards["a1"].parent == "tiny-parent"
    assert getattr(cards[TINY_MODEL_NAME], "parent", None) is None
    assert client.models.retrieve("a0").parent == TINY_MODEL_NAME

    tokenizer = transformers.AutoTokenizer.from_pretrained(lora_base)
    prompt = lora_prompts[1]
    names = [None, "a0", "a1"]
    expected = peft_greedy(
        lora_base, {n: lora_adapters[n] for n in names[1:]}, [(prompt, n) for n in names],
        MAX_TOKENS,
    )
    for name, tokens in zip(names, expected):
        assert _completion_text(client, name or TINY_MODEL_NAME, prompt) == _final_text(tokenizer, tokens)
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0.0,
    )
    assert chat.model == "a1"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _completion_text(client, "a9", prompt)


def test_load_and_unload_at_runtime(lora_server, lora_base, lora_adapters, lora_prompts, tmp_path):
    client = lora_server.client()
    prompt = lora_prompts[0]
    with lora_server.http() as http:
        # Behind the API key.
        anonymous = httpx.post(
            f"{lora_server.url}/v1/load_lora_adapter",
            json={"lora_name": "a2", "lora_path": lora_adapters["a2"]},
        )
        assert anonymous.status_code == 401
        bad = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "bad", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "is not a directory" in bad.json()["error"]["message"]
        again = http.post("/v1/load_lora_adapter",
                          json={"lora_name": "a0", "lora_path": lora_adapters["a0"]})
        assert again.status_code == 400 and "already been loaded" in again.text
        for name in ("a2", "a3"):
            loaded = http.post("/v1/load_lora_adapter",
                               json={"lora_name": name, "lora_path": lora_adapters[name]})
            assert loaded.status_code == 200, loaded.text
        assert {"a2", "a3"} <= {card.id for card in client.models.list().data}
        # Four adapters on two slots and two loaded copies: each request still equals peft.
        tokenizer = transformers.AutoTokenizer.from_pretrained(lora_base)
        names = ["a2", "a3", "a0", "a2"]
        expected = peft_greedy(
            lora_base, {n: lora_adapters[n] for n in set(names)}, [(prompt, n) for n in names],
            MAX_TOKENS,
        )
        for name, tokens in zip(names, expected):
            assert _completion_text(client, name, prompt) == _final_text(tokenizer, tokens)

        removed = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert removed.status_code == 200
        assert "a2" not in {card.id for card in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            _completion_text(client, "a2", prompt)
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert missing.status_code == 404 and missing.json()["error"]["message"]
        # Loaded again under the same name: a new adapter id, the same outputs.
        assert http.post("/v1/load_lora_adapter",
                         json={"lora_name": "a2", "lora_path": lora_adapters["a2"]}).status_code == 200
        assert _completion_text(client, "a2", prompt) == _final_text(tokenizer, expected[0])


def test_runtime_updating_is_opt_in(tiny_server):
    """Without --allow-runtime-lora-updating (and --enable-lora) the routes do not exist."""
    with tiny_server.http() as http:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert response.status_code == 404
        assert "error" in response.json()
