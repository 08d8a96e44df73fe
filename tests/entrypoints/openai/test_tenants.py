"""Two tenants on one server: separate prefix caches, keys kept out of the log, and
backpressure (503 with Retry-After) once the engine holds all it may.

The server has one key on the command line and one in a key file, runs at most 2
sequences and lets 1 more wait (capacity 3), and has the default request policy (no chat
templates from requests).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.openai.remote_server import RemoteServer, metric_value
from tests.entrypoints.openai.test_errors import assert_error

KEY_ALPHA = "alpha-key-3f9a"
KEY_BETA = "beta-key-77c1"
CAPACITY = 3  # --max-num-seqs 2 + --max-waiting-requests 1
# ~100 tokens: a dozen full blocks of 8.
SHARED_PROMPT = "The quick brown fox jumps over the lazy dog. " * 10


@pytest.fixture(scope="module")
def tenant_server(tiny_model_dirs: dict[str, str], tmp_path_factory) -> Iterator[RemoteServer]:
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# tenants\n{KEY_BETA}\n")
    server = RemoteServer(
        tiny_model_dirs["llama"],
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "1024",
        "--block-size",
        "8",
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "1",
        "--api-key-file",
        str(key_file),
        api_key=KEY_ALPHA,
    )
    yield server
    server.stop()


def http_for(server: RemoteServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def cached_tokens(server: RemoteServer, key: str, **fields) -> int:
    body = {"prompt": SHARED_PROMPT, "max_tokens": 1, **fields}
    with http_for(server, key) as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_both_keys_are_accepted_and_others_refused(tenant_server):
    for key in (KEY_ALPHA, KEY_BETA):
        with http_for(tenant_server, key) as http:
            assert http.get("/v1/models").status_code == 200
    with http_for(tenant_server, "gamma") as http:
        assert_error(http.get("/v1/models"), 401)


def test_a_prompt_cached_under_one_key_is_not_cached_under_the_other(tenant_server):
    cached_tokens(tenant_server, KEY_ALPHA)
    assert cached_tokens(tenant_server, KEY_ALPHA) > 0  # alpha's own cache works
    assert cached_tokens(tenant_server, KEY_BETA) == 0
    assert cached_tokens(tenant_server, KEY_BETA) > 0
    # A request's own cache_salt splits its tenant's cache further.
    assert cached_tokens(tenant_server, KEY_ALPHA, cache_salt="project-x") == 0


def test_api_keys_never_reach_the_log(tenant_server):
    cached_tokens(tenant_server, KEY_BETA)
    with http_for(tenant_server, "wrong-key-guess") as http:
        http.get("/v1/models")
    log = tenant_server.log_text()
    assert KEY_BETA not in log and "wrong-key-guess" not in log
    # KEY_ALPHA is on the command line (which the log does not echo either).
    assert KEY_ALPHA not in log


def test_chat_templates_from_requests_are_refused_by_default(tenant_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 7 * 6 }}"}
    with http_for(tenant_server, KEY_ALPHA) as http:
        error = assert_error(http.post("/v1/chat/completions", json=body), 400)
        assert error["param"] == "chat_template"
        assert_error(http.post("/tokenize", json=body), 400)


def wait_for_metric(server: RemoteServer, name: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        if metric_value(text, name) == value:
            return
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.1)


def test_full_server_answers_503_with_retry_after_then_recovers(tenant_server):
    long_stream = {
        "prompt": "Once upon a time",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with contextlib.ExitStack() as streams, http_for(tenant_server, KEY_ALPHA) as http:
        for _ in range(CAPACITY):  # 2 running, 1 waiting
            client = streams.enter_context(http_for(tenant_server, KEY_BETA))
            response = streams.enter_context(
                client.stream("POST", "/v1/completions", json=long_stream)
            )
            assert response.status_code == 200
        wait_for_metric(tenant_server, "tokenserve:num_requests_waiting", 1)
        # Paused, the running streams cannot finish and make room while the test asks.
        with tenant_server.engine_paused():
            for body in (long_stream, {"prompt": "Hello", "max_tokens": 2}):
                response = http.post("/v1/completions", json=body)
                error = assert_error(response, 503)
                assert error["code"] == "server_overloaded"
                assert response.headers["Retry-After"].isdigit()
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert_error(http.post("/v1/chat/completions", json=chat), 503)
            # More sequences than the server could ever hold is the request's fault: 400.
            error = assert_error(
                http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "n": 4}),
                400,
            )
            assert error["param"] == "n"
    # The streams are closed: their requests are aborted and the server takes work again.
    wait_for_metric(tenant_server, "tokenserve:kv_cache_usage_perc", 0)
    with http_for(tenant_server, KEY_ALPHA) as http:
        assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).is_success
