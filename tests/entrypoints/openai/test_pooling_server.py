"""The pooling routes over HTTP, against `tokenserve serve --runner pooling` processes:
the official `openai` client's `embeddings.create` (float and base64, `dimensions` on a
matryoshka model) equals the offline engine's embeddings; /score, /v1/score, /rerank,
/v1/rerank, /v2/rerank and /classify on a cross-encoder equal its logits through the sigmoid
(softmax for classify); errors are 400s in OpenAI's shape, and a generate route on a pooling
server (or /v1/embeddings on a generate server) is one too."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import transformers

from tests.entrypoints.openai.remote_server import RemoteServer
from tests.pooling_models import build_bert_cross_encoder, build_qwen3_st_dir

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!"]
QUERY = "where do penguins live"
DOCUMENTS = ["paris is the capital of france", "most in the southern hemisphere", "the sky"]


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory) -> Iterator[tuple[RemoteServer, object]]:
    directory = tmp_path_factory.mktemp("qwen3_embedding")
    reference = build_qwen3_st_dir(Path(directory), "lasttoken", is_matryoshka=True)
    server = RemoteServer(
        str(Path(directory) / "st"), "--runner", "pooling", "--served-model-name", "tiny-embed",
        "--num-kv-blocks", "16", "--block-size", "16",
    )
    yield server, reference
    server.stop()


@pytest.fixture(scope="module")
def cross_encoder_server(tmp_path_factory) -> Iterator[tuple[RemoteServer, object, object]]:
    directory = tmp_path_factory.mktemp("bert_cross_encoder")
    model = build_bert_cross_encoder(Path(directory), num_labels=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    server = RemoteServer(
        str(directory), "--served-model-name", "tiny-rerank", "--num-kv-blocks", "16",
        "--block-size", "16",
    )
    yield server, model, tokenizer
    server.stop()


def test_openai_client_embeddings(embedding_server):
    server, reference = embedding_server
    client = server.client()
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    # Unasked, the client requests base64 and decodes it; then float, then base64 asked for.
    for encoding_format in (openai.NOT_GIVEN, "float", "base64"):
        response = client.embeddings.create(
            model="tiny-embed", input=TEXTS, encoding_format=encoding_format
        )
        got = torch.tensor([_as_floats(item.embedding) for item in response.data])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert [item.index for item in response.data] == [0, 1]
    num_tokens = sum(len(reference.tokenizer(text)["input_ids"]) for text in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens

    short = client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=16)
    pooled = reference.encode(TEXTS[0], convert_to_tensor=True, normalize_embeddings=False)
    torch.testing.assert_close(
        torch.tensor(short.data[0].embedding),
        torch.nn.functional.normalize(pooled[:16], dim=-1), atol=1e-5, rtol=0,
    )
    # Token ids as input, and the raw base64 body (float32, little-endian).
    ids = reference.tokenizer(TEXTS[1])["input_ids"]
    with server.http() as http:
        body = http.post(
            "/v1/embeddings", json={"input": ids, "encoding_format": "base64"}
        ).json()
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(decoded.copy()), expected[1], atol=1e-5, rtol=0)
    assert body["object"] == "list" and body["model"] == "tiny-embed"


def _as_floats(embedding: list[float] | str) -> list[float]:
    if isinstance(embedding, str):  # base64 of float32, little-endian
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4").tolist()
    return embedding


def test_embedding_model_scores_by_cosine_similarity(embedding_server):
    server, reference = embedding_server
    embeddings = reference.encode([QUERY, *DOCUMENTS], convert_to_tensor=True)
    cosine = (embeddings[1:] @ embeddings[0]).tolist()
    with server.http() as http:
        body = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
    by_index = {result["index"]: result["relevance_score"] for result in body["results"]}
    assert [by_index[i] for i in range(3)] == pytest.approx(cosine, abs=1e-5)


def test_pooling_errors(embedding_server, cross_encoder_server):
    server, _ = embedding_server
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="does not generate text"):
        client.completions.create(model="tiny-embed", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most the model's hidden size"):
        client.embeddings.create(model="tiny-embed", input="Hello", dimensions=1000)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="Hello")
    with server.http() as http:
        for path, body, message in [
            ("/v1/embeddings", {"input": []}, "input must not be empty"),
            ("/v1/embeddings", {"input": [10**9]}, "out of range"),
            ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
            ("/classify", {"input": "Hello"}, "does not support the 'classify' task"),
        ]:
            response = http.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            assert message in response.json()["error"]["message"]
    cross, _, _ = cross_encoder_server
    with cross.http() as http:
        response = http.post("/v1/embeddings", json={"input": "Hello"})
        assert response.status_code == 400
        assert "does not support the 'embed' task" in response.json()["error"]["message"]
        response = http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
        assert response.status_code == 400
        assert "give one text_1" in response.json()["error"]["message"]


def test_cross_encoder_score_rerank_classify(cross_encoder_server):
    server, model, tokenizer = cross_encoder_server
    with torch.no_grad():
        batch = tokenizer([QUERY] * 3, DOCUMENTS, return_tensors="pt", padding=True)
        logits = model(**batch).logits[:, 0]
    expected = torch.sigmoid(logits).tolist()
    with server.http() as http:
        for path in ("/score", "/v1/score"):
            body = http.post(path, json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
            assert [item["score"] for item in body["data"]] == pytest.approx(expected, abs=1e-5)
        body = http.post(
            "/score", json={"text_1": QUERY, "text_2": DOCUMENTS, "use_activation": False}
        ).json()
        assert [item["score"] for item in body["data"]] == pytest.approx(logits.tolist(), abs=1e-5)
        order = sorted(range(3), key=lambda i: expected[i], reverse=True)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            body = http.post(path, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
            assert [r["index"] for r in body["results"]] == order[:2]
            texts = [r["document"]["text"] for r in body["results"]]
            assert texts == [DOCUMENTS[i] for i in order[:2]]
            assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
                [expected[i] for i in order[:2]], abs=1e-5
            )
            assert body["usage"]["total_tokens"] == int(batch["attention_mask"].sum())
        body = http.post("/classify", json={"input": DOCUMENTS}).json()
        with torch.no_grad():
            single = model(**tokenizer(DOCUMENTS, return_tensors="pt", padding=True)).logits
        assert [item["probs"] for item in body["data"]] == [
            pytest.approx(p, abs=1e-5) for p in torch.sigmoid(single).tolist()
        ]
        assert body["data"][0]["num_classes"] == 1 and body["data"][0]["label"] == "LABEL_0"


def test_embeddings_on_a_generate_server_is_a_400(tiny_server):
    with tiny_server.http() as http:
        response = http.post("/v1/embeddings", json={"input": "Hello"})
    assert response.status_code == 400
    assert "runs the 'generate' runner" in response.json()["error"]["message"]
