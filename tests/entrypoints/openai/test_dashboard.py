"""/dashboard and --request-trace on a real tiny-model server: the page and its JSON behind
the API key, the figures moving during a load (in headless Chromium too), and the
recorded trace replayed by `bench serve --dataset mooncake`."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import httpx
import pytest

from tests.entrypoints.openai.remote_server import API_KEY, TINY_MODEL_NAME, RemoteServer
from tokenserve.benchmarks import mooncake
from tokenserve.entrypoints.cli import main

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"
# Set to a PNG path to keep the browser test's screenshot (docs/diagnosis/dashboard.png).
SCREENSHOT_ENV = "TOKENSERVE_DASHBOARD_SCREENSHOT"


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "served.jsonl"


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, str], trace_path: Path) -> Iterator[RemoteServer]:
    server = RemoteServer(
        tiny_model_dirs["llama"],
        "--served-model-name", TINY_MODEL_NAME,
        "--num-kv-blocks", "160",
        "--max-model-len", "1024",
        "--block-size", "8",
        "--max-num-seqs", "8",
        "--request-trace", str(trace_path),
        api_key=API_KEY,
    )
    yield server
    server.stop()


class Load:
    """Completions sent by a few threads until stopped (so the dashboard has something to show)."""

    def __init__(self, server: RemoteServer, threads: int = 4, max_tokens: int = 48) -> None:
        self.stop = threading.Event()
        self.completed = 0
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(server, i, max_tokens), daemon=True)
                         for i in range(threads)]

    def _run(self, server: RemoteServer, index: int, max_tokens: int) -> None:
        with server.http() as http:
            number = 0
            while not self.stop.is_set():
                # A shared 64-token prefix (8 blocks of 8), then the request's own tokens.
                prompt = [100 + (i % 50) for i in range(64)] + [200 + index, 300 + number % 97]
                response = http.post("/v1/completions", json={
                    "model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0.0})
                if response.status_code != 200:
                    self.errors.append(response.text)
                self.completed += 1
                number += 1

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def test_dashboard_is_behind_the_api_key(server):
    for path in ("/dashboard", "/dashboard/state"):
        response = httpx.get(server.url + path)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"].startswith("Basic")
    page = httpx.get(server.url + "/dashboard", headers=server.headers)
    assert page.status_code == 200 and "<canvas" in page.text
    # A browser's own login prompt: any user name, the key as password.
    basic = "Basic " + base64.b64encode(f"me:{API_KEY}".encode()).decode()
    assert httpx.get(server.url + "/dashboard/state", headers={"Authorization": basic}).status_code == 200
    wrong = "Basic " + base64.b64encode(b"me:wrong").decode()
    assert httpx.get(server.url + "/dashboard/state", headers={"Authorization": wrong}).status_code == 401


def test_dashboard_state_moves_during_a_load(server):
    with server.http() as http:
        before = http.get("/dashboard/state").json()
        seen_in_use = seen_running = False
        with Load(server) as load:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (seen_in_use and seen_running and load.completed >= 8):
                state = http.get("/dashboard/state").json()
                seen_in_use |= any(owner >= 0 or owner == -3 for owner in state["blocks"])
                seen_running |= any(r["status"] == "running" for r in state["requests"])
                time.sleep(0.05)
        assert not load.errors, load.errors[:1]
        time.sleep(0.5)  # the idle engine's last stats
        after = http.get("/dashboard/state").json()
    assert seen_in_use and seen_running
    assert len(after["blocks"]) == 160
    assert after["total_decode_tokens"] > before["total_decode_tokens"]
    assert after["total_prefill_tokens"] > before["total_prefill_tokens"]
    assert any(prefill > 0 for _, prefill, _ in after["steps"])
    assert any(decode > 0 for _, _, decode in after["steps"])
    # The shared 64-token prefix is found in the cache after the first request.
    assert after["prefix_cache_hit_rate"] > 0
    finished = [t for t in after["timelines"] if t["finished"] is not None]
    assert finished and all(t["arrival"] <= t["first_token"] <= t["finished"] for t in finished)
    assert all(t["num_output_tokens"] == 48 for t in finished if t["finish_reason"] == "length")
    # Idle again: no block in use, nothing queued.
    assert after["num_running_reqs"] == 0 and not after["requests"]
    assert all(owner < 0 and owner != -3 for owner in after["blocks"])


def test_request_trace_records_and_replays(server, trace_path, tiny_tokenizer_dir, tmp_path):
    with server.http() as http:
        for suffix in ([1, 2, 3], [4, 5, 6]):
            prompt = [100 + i % 50 for i in range(1100)] + suffix
            response = http.post("/v1/completions", json={
                "model": TINY_MODEL_NAME, "prompt": prompt[:1000], "max_tokens": 5,
                "ignore_eos": True})
            assert response.status_code == 200
    entries = mooncake.read_trace(str(trace_path))
    assert "prompt" not in trace_path.read_text() and "text" not in trace_path.read_text()
    last_two = entries[-2:]
    assert [(e.input_length, e.output_length) for e in last_two] == [(1000, 5), (1000, 5)]
    assert last_two[0].hash_ids == last_two[1].hash_ids and len(last_two[0].hash_ids) == 2
    assert all(b.timestamp >= a.timestamp for a, b in itertools.pairwise(entries))
    replay = tmp_path / "replay.jsonl"
    mooncake.write_trace(entries[-6:], str(replay))
    output = tmp_path / "bench.json"
    argv = ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY,
            "--tokenizer", tiny_tokenizer_dir, "--dataset", "mooncake", "--trace", str(replay),
            "--ignore-eos", "--output-json", str(output)]
    assert main(argv) == 0, server.log_text()[-2000:]
    summary = json.loads(output.read_text())["summary"]
    assert summary["completed"] == 6
    assert summary["total_output_tokens"] == sum(e.output_length for e in entries[-6:])
    assert summary["total_input_tokens"] == sum(e.input_length for e in entries[-6:])


def test_dashboard_in_headless_chromium(server, tmp_path):
    if not (os.path.exists(CHROMEDRIVER) and shutil.which(CHROMIUM)):
        pytest.skip("chromedriver / chromium not installed (scripts/install.sh --test installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1300,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        # Every request of the page carries the key (navigation and its fetches alike).
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": server.headers})
        driver.get(server.url + "/dashboard")

        def figure(element_id: str) -> str:
            return driver.find_element("id", element_id).text

        with Load(server, max_tokens=64):
            deadline = time.monotonic() + 60
            first = figure("decode-total")
            while time.monotonic() < deadline and figure("decode-total") in (first, "-"):
                time.sleep(0.2)
            moved = figure("decode-total")
            seen_running = False
            while time.monotonic() < deadline and not seen_running:
                seen_running = figure("running") not in ("0", "-")
                time.sleep(0.1)
            driver.save_screenshot(os.environ.get(SCREENSHOT_ENV) or str(tmp_path / "dashboard.png"))
        assert figure("error") == ""
        assert moved not in (first, "-") and int(moved) > 0
        assert seen_running
        assert figure("hit-rate").endswith("%")
    finally:
        driver.quit()
