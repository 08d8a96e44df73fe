"""A `tokenserve serve` restarted on the same SharedStorageConnector directory reports the
stored prompt as cached tokens (usage.prompt_tokens_details.cached_tokens) and gives the
same greedy output; the connector's counters reach /metrics."""

from __future__ import annotations

import json

from tests.entrypoints.openai.remote_server import RemoteServer, metric_value

BLOCK_SIZE = 16
PROMPT = list(range(3, 3 + 4 * BLOCK_SIZE + 7))  # four full blocks and a partial one


def serve(model: str, storage: str) -> RemoteServer:
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": storage, "max_size_gb": 1},
    }
    return RemoteServer(
        model, "--served-model-name", "tiny", "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory", "32MiB", "--max-model-len", "512",
        "--kv-transfer-config", json.dumps(config),
    )


def complete(server: RemoteServer) -> tuple[str, int, str]:
    with server.http() as http:
        response = http.post("/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        })
        assert response.status_code == 200, response.text
        body = response.json()
        metrics = http.get("/metrics").text
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"], metrics


def test_restarted_server_serves_the_stored_prompt(tiny_model_dirs, tmp_path):
    storage = str(tmp_path / "kv")
    server = serve(tiny_model_dirs["llama"], storage)
    try:
        text, cached, metrics = complete(server)
    finally:
        server.stop()
    assert cached == 0
    assert metric_value(metrics, "tokenserve:kv_connector_bytes_saved_total") > 0

    server = serve(tiny_model_dirs["llama"], storage)
    try:
        again, cached, metrics = complete(server)
    finally:
        server.stop()
    assert again == text
    assert cached == 4 * BLOCK_SIZE
    assert metric_value(metrics, "tokenserve:external_prefix_cache_hits_total") == 4 * BLOCK_SIZE
    assert metric_value(metrics, "tokenserve:external_prefix_cache_queries_total") == len(PROMPT)
    assert metric_value(metrics, "tokenserve:kv_connector_bytes_loaded_total") > 0
