"""A request that arrives while `tokenserve serve` is still loading its engine waits for it.

The API process binds its port before it waits for the engine (as vLLM's server does), so a
client that connects early is answered once the engine is ready: /health 200 and a served
completion, never a refused connection or a 503 (docs/STARTUP.md).
"""

from __future__ import annotations

import concurrent.futures
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME, free_port


def test_requests_made_during_the_start_are_answered_once_ready(tiny_model_dirs: dict[str, str]):
    port = free_port()
    command = [sys.executable, "-m", "tokenserve.entrypoints.cli", "serve",
               tiny_model_dirs["llama"], "--port", str(port), "--disable-log-stats",
               "--served-model-name", TINY_MODEL_NAME, "--max-model-len", "256",
               "--num-kv-blocks", "16", "--block-size", "16"]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:  # the first moment the port accepts a connection
                assert process.poll() is None, "the server exited while starting"
                assert time.monotonic() < deadline, "the port was never bound"
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.01)
            url = f"http://127.0.0.1:{port}"
            body = {"model": TINY_MODEL_NAME, "prompt": "hello", "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True}
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                health = pool.submit(httpx.get, f"{url}/health", timeout=300)
                completion = pool.submit(httpx.post, f"{url}/v1/completions", json=body,
                                         timeout=300)
                assert health.result().status_code == 200
                response = completion.result()
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
        finally:
            process.terminate()
            process.wait(timeout=60)
