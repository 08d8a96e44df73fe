"""Server lifecycle: --chat-template, SIGTERM with a request in flight (drained, or cut at
--shutdown-timeout), engine-core death with requests in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.remote_server import RemoteServer, metric_value

OVERRIDE_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    with open(f"/proc/{pid}/stat") as file:
        return file.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def num_running(http: httpx.Client) -> float:
    return metric_value(http.get("/metrics").text, "tokenserve:num_requests_running")


@pytest.fixture
def template_file(tmp_path) -> str:
    path = tmp_path / "template.jinja"
    path.write_text(OVERRIDE_TEMPLATE)
    return str(path)


def test_sigterm_finishes_in_flight_requests_and_stops_the_engine(tiny_model_dirs, template_file):
    server = RemoteServer(
        tiny_model_dirs["qwen2"], "--kv-cache-memory", "64MiB", "--chat-template", template_file
    )
    try:
        with server.http() as http:
            # --chat-template replaces the model's ChatML template.
            tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
            text = http.post("/detokenize", json={"tokens": tokens.json()["tokens"]}).json()[
                "prompt"
            ]
            assert text == "<user>hi"

            engine_pid = server.engine_core_pid()
            body = {
                "prompt": "Once upon a time",
                "max_tokens": 40,
                "stream": True,
                "ignore_eos": True,
            }
            texts = []
            with http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if not texts:
                        server.process.send_signal(signal.SIGTERM)
                    if line == "data: [DONE]":
                        break
                    texts.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
        # The request in flight was answered in full before the server stopped.
        assert len(texts) >= 2 and response.status_code == 200
        assert server.process.wait(timeout=60) == 0
        assert wait_for(lambda: not pid_exists(engine_pid), 10)
        assert "Server stopped." in server.log_text()
    finally:
        server.stop()


def test_sigterm_cuts_requests_still_running_at_the_shutdown_timeout(tiny_model_dirs):
    server = RemoteServer(
        tiny_model_dirs["qwen2"], "--kv-cache-memory", "64MiB", "--shutdown-timeout", "0"
    )
    try:
        engine_pid = server.engine_core_pid()
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        events = 0
        with (
            server.http() as http,
            http.stream("POST", "/v1/completions", json=body) as response,
            pytest.raises(httpx.HTTPError),  # the connection closes mid-stream
        ):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 1:
                        server.process.send_signal(signal.SIGTERM)
                    assert line != "data: [DONE]"
        assert 1 <= events < 2000
        assert server.process.wait(timeout=60) == 0
        assert wait_for(lambda: not pid_exists(engine_pid), 10)
    finally:
        server.stop()


def test_engine_death_is_reported_and_requests_fail_fast(tiny_model_dirs):
    server = RemoteServer(tiny_model_dirs["mistral"], "--kv-cache-memory", "64MiB")
    try:
        long_request = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True}
        in_flight: dict[str, httpx.Response] = {}

        def post_in_background() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                in_flight["response"] = http.post("/v1/completions", json=long_request)

        poster = threading.Thread(target=post_in_background)
        poster.start()
        stream_events: list[dict] = []
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream(
                "POST", "/v1/completions", json={**long_request, "stream": True}
            ) as stream:
                for line in stream.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    stream_events.append(json.loads(line[len("data: ") :]))
                    if len(stream_events) == 1:
                        assert wait_for(lambda: num_running(http) == 2, 30)  # both in flight
                        os.kill(server.engine_core_pid(), signal.SIGKILL)
            poster.join(timeout=60)
            # The request in flight fails at once with 500; the stream (200 already sent)
            # ends with an error event.
            response = in_flight["response"]
            assert response.status_code == 500
            assert "engine" in response.json()["error"]["message"].lower()
            assert "engine" in stream_events[-1]["error"]["message"].lower()
            assert wait_for(lambda: http.get("/health").status_code == 503, 20)
            health = http.get("/health").json()
            assert set(health["error"]) == {"message", "type", "param", "code"}
            # A new request fails at once with 500 instead of hanging (timeout=30 above).
            response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert response.status_code == 500
            assert "engine" in response.json()["error"]["message"].lower()
            chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            assert http.post("/v1/chat/completions", json=chat).status_code == 500
        # Then the server exits non-zero, so that a supervisor restarts it.
        assert server.process.wait(timeout=60) != 0
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after its engine died:\n{server.log_text()[-3000:]}")
    finally:
        server.stop()
