"""Server lifecycle: --chat-template, SIGTERM with a request in flight (drained, or cut at
--shutdown-timeout), engine-core death with requests in flight."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.remote_server import (
    RemoteServer,
    data_events,
    free_port,
    metric_value,
)

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


def accepts_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    except ConnectionRefusedError:
        return False
    return True


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
                "stream_options": {"include_usage": True},
            }
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = data_events(response)
                first = next(events)
                # Paused, the request is still in flight when the server takes the signal: it
                # stops listening at once, then drains.
                with server.engine_paused():
                    server.process.send_signal(signal.SIGTERM)
                    assert wait_for(lambda: not accepts_connections(server.port), 60)
                # Counted in tokens, not events: a slow reader gets several tokens per event.
                rest = list(events)  # to [DONE]
        # The request in flight was answered in full before the server stopped.
        choices = [choice for event in (first, *rest) for choice in event["choices"]]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        assert rest[-1]["usage"]["completion_tokens"] == 40
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
        with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            assert next(lines) != "data: [DONE]"
            events = 1
            # Paused, the request cannot end before the shutdown cuts it.
            with server.engine_paused(), pytest.raises(httpx.HTTPError):  # closed mid-stream
                server.process.send_signal(signal.SIGTERM)
                for line in lines:
                    assert line != "data: [DONE]"
                    events += 1
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


def test_an_engine_that_fails_to_load_stops_the_server_with_its_error(tiny_model_dirs, tmp_path):
    # The API process builds its app while the engine core loads, then waits for it: an
    # engine that fails there (weights cut short: the configuration and the tokenizer are
    # fine) ends the server with a non-zero exit code and the engine's error, and frees the
    # port it had bound.
    model = tmp_path / "cut"
    shutil.copytree(tiny_model_dirs["llama"], model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "tokenserve.entrypoints.cli", "serve", str(model),
         "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "64MiB"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "The engine core failed to start" in output, output[-3000:]
    assert not accepts_connections(port)
