"""Prefill/decode disaggregation over HTTP: two `tokenserve serve` instances (P2pConnector,
kv_producer and kv_consumer) behind `tokenserve proxy`. Chat and completions, streamed or
not, give what one instance gives, and the decode instance's cached tokens cover the
prompt (all but its last token); a failed prefill and a failed transfer are OpenAI-style
errors, and both instances' KV caches empty again. On the tiny llama and the default model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.entrypoints.openai.remote_server import RemoteServer, free_port, metric_value

SECRET = "tests-shared-secret-0123456789"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow and one fruit."}]


def instance(model: str | None, role: str, secret: str | None = None, *args: str) -> RemoteServer:
    extra = {"transfer_timeout_s": 20, "send_timeout_s": 20}
    if secret is not None:
        extra["secret"] = secret
    config = {"kv_connector": "P2pConnector", "kv_role": role, "kv_ip": "127.0.0.1",
              "kv_port": free_port(), "kv_connector_extra_config": extra}
    return RemoteServer(model, "--served-model-name", "m", "--kv-cache-memory", "64MiB",
                        "--max-model-len", "1024", "--kv-transfer-config", json.dumps(config),
                        *args)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "tokenserve.entrypoints.cli", "proxy", "--prefill",
                   *prefill, "--decode", *decode, "--port", str(self.port)]
        self.process = subprocess.Popen(command)
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, "tokenserve proxy exited"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "tokenserve proxy did not start"
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module", params=["tiny", "default"])
def deployment(request, monkeypatch_module, tiny_model_dirs):
    model = tiny_model_dirs["llama"] if request.param == "tiny" else None
    monkeypatch_module.setenv("TOKENSERVE_KV_SECRET", SECRET)  # the secret from the environment
    prefill = instance(model, "kv_producer")
    decode = instance(model, "kv_consumer")
    proxy = Proxy([prefill.url], [decode.url])
    yield prefill, decode, proxy
    proxy.stop()
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def post(url: str, route: str, body: dict) -> dict:
    response = httpx.post(url + route, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def stream(url: str, route: str, body: dict) -> tuple[str, dict]:
    text, usage = "", {}
    with httpx.stream("POST", url + route, json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for choice in event.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            usage = event.get("usage") or usage
    return text, usage


def caches_empty(*servers: RemoteServer) -> None:
    """Every instance's KV cache usage returns to 0 (bounded wait, not a timing assert)."""
    deadline = time.monotonic() + 60
    for server in servers:
        while metric_value(httpx.get(server.url + "/metrics").text,
                           "tokenserve:kv_cache_usage_perc") != 0:
            assert time.monotonic() < deadline, f"{server.url} kept blocks"
            time.sleep(0.2)


def test_outputs_equal_one_instance(deployment):
    prefill, decode, proxy = deployment
    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    completion = {"model": "m", "prompt": "The capital of France is a city where",
                  "max_tokens": 12, "temperature": 0}
    for route, body, field in (("/v1/chat/completions", chat, "message"),
                               ("/v1/completions", completion, None)):
        alone = post(prefill.url, route, body)  # one instance, no transfer
        split = post(proxy.url, route, body)
        choice = (lambda b: b["choices"][0]["message"]["content"]) if field else (
            lambda b: b["choices"][0]["text"])
        assert choice(split) == choice(alone)
        usage = split["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        streamed, stream_usage = stream(proxy.url, route, body)
        assert streamed == choice(alone)
        assert stream_usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    metrics = httpx.get(decode.url + "/metrics").text
    assert metric_value(metrics, "tokenserve:kv_connector_bytes_loaded_total") > 0
    caches_empty(prefill, decode)


def test_failed_prefill_is_an_openai_error(deployment):
    _, decode, _ = deployment
    proxy = Proxy([f"http://127.0.0.1:{free_port()}"], [decode.url])  # nobody listens there
    try:
        response = httpx.post(proxy.url + "/v1/completions", timeout=60,
                              json={"model": "m", "prompt": "hello", "max_tokens": 4})
    finally:
        proxy.stop()
    assert response.status_code == 502
    assert "prefill instance" in response.json()["error"]["message"]


@pytest.mark.parametrize("deployment", ["tiny"], indirect=True)  # once, on the tiny model
def test_failed_transfer_is_an_error_and_frees_both(deployment, tiny_model_dirs):
    prefill, _, _ = deployment
    stranger = instance(tiny_model_dirs["llama"], "kv_consumer", "a-different-secret-0123")
    proxy = Proxy([prefill.url], [stranger.url])
    try:
        body = {"model": "m", "prompt": "hello there, how are you", "max_tokens": 4}
        response = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "kv_transfer_failed"
        caches_empty(prefill, stranger)
    finally:
        proxy.stop()
        stranger.stop()
