"""A real `tokenserve serve` process on 127.0.0.1, for tests to drive over HTTP.

`RemoteServer` starts the command, waits (bounded) until /health answers 200, and stops
the process by its PID. The server's log goes to a file, shown on failure. A test can
pause the engine core (SIGSTOP) so that no request progresses while it acts, instead of
racing generation speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

API_KEY = "test-key-123"
TINY_MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    def __init__(self, model: str | None, *args: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self._engine_core_pid: int | None = None
        command = [sys.executable, "-m", "tokenserve.entrypoints.cli", "serve"]
        command += [model] if model is not None else []
        command += ["--port", str(self.port), "--disable-log-stats", *args]
        if "--dtype" not in args:
            # As in-process tests (tests/conftest.py): float32, the dtype the server tests
            # compare with transformers in, unless a test asks for another.
            command += ["--dtype", "float32"]
        if api_key is not None:
            command += ["--api-key", api_key]
        # Kept open for the server's lifetime; closed (and removed) by stop().
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", prefix="tokenserve-server-", suffix=".log"
        )
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_until_healthy()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0
        )

    def http(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as file:
            return file.read()

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tokenserve serve exited early:\n{self.log_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tokenserve serve did not become healthy:\n{self.log_text()[-4000:]}")

    def engine_core_pid(self) -> int:
        """The PID of the engine-core process (the server's multiprocessing child)."""
        if self._engine_core_pid is None:
            self._engine_core_pid = self._find_engine_core_pid()
        return self._engine_core_pid

    def _find_engine_core_pid(self) -> int:
        pids = self.engine_core_pids()
        if not pids:
            raise RuntimeError("The engine core process was not found.")
        return pids[0]

    def engine_core_pids(self) -> list[int]:
        """The server's engine-core processes (its multiprocessing children), by PID."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as file:
                    parent = int(file.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    cmdline = file.read()
            except (OSError, ValueError, IndexError):
                continue
            if parent == self.process.pid and b"spawn_main" in cmdline:
                pids.append(int(entry))
        return sorted(pids)

    @contextlib.contextmanager
    def engine_paused(self) -> Iterator[None]:
        """The engine core stopped (SIGSTOP) for the block, then continued.

        No step runs meanwhile, so no request gains a token or finishes, while the API
        process goes on answering: what the test does inside (a client leaving, a probe
        request) cannot race generation, however fast or loaded the host is.
        """
        pid = self.engine_core_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone: nothing to continue
                os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def open_stream_once_admitted(
    http: httpx.Client, body: dict[str, Any], timeout_s: float = 60.0
) -> httpx.Response:
    """POST the streaming completion `body` until it is not refused with 503; its open response.

    A request for as many sequences as the server may hold is admitted only once the API
    process holds no other request: how a test sees that requests were let go (their
    clients left) without racing anything. The headers come at admission, so this works
    while the engine is paused. The caller closes the response.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        response = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        if response.status_code != 503:
            return response
        response.close()
        assert time.monotonic() < deadline, "the server never let go of its other requests"
        time.sleep(0.05)


def data_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The data events of a server-sent event stream, parsed, as they come until [DONE].

    Take one iterator per response and draw from it (`itertools.islice` for the next few):
    an error event, or a stream that closes without [DONE], fails.
    """
    for line in response.iter_lines():
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            yield event
    raise AssertionError("the stream closed without [DONE]")


def stop_string_inside(text: str) -> str:
    """Two plain letters from inside a (random model's) greedy text, to use as a stop string."""
    for start in range(1, len(text) - 2):
        pair = text[start : start + 2]
        if pair.isascii() and pair.isalpha():
            return pair
    pytest.skip(f"no plain-letter pair in the tiny model's text {text!r}")


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text exposition (summed over other labels)."""
    total = 0.0
    found = False
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        sample, _, value = line.rpartition(" ")
        sample_name, _, label_text = sample.partition("{")
        if sample_name != name:
            continue
        if all(f'{key}="{val}"' in label_text for key, val in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"metric {name}{labels} not found")
    return total
