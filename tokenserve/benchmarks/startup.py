"""`tokenserve bench startup`: how long `tokenserve serve` takes to answer, and its memory.

Each run starts `tokenserve serve [serve args]` as a subprocess on a free port of
127.0.0.1, waits for /health to answer 200, then streams one chat request (temperature 0,
max_tokens 8). Every time is in seconds from the moment the process was started:
`import` (the engine-core process has imported its modules), `configured` (it has built
its configuration from the engine arguments the API process handed it) and `load` (the
engine core is ready: model loaded, KV cache allocated) come from the server's log;
`ready` (/health 200), `first_token` (the first streamed content) and `first_answer` (the
whole answer) are seen by the client. After the answer, the resident memory of the API
process and the engine-core process (psutil). `--cold` empties tokenserve's cache
directory (converted tokenizers, built kernels, expanded weights) before each run and
builds the kernels again as `scripts/install.sh` does (timed apart): the "right after a
fresh install" figure. The server writes and reads its modules' bytecode, as an installed
package does, whatever PYTHONDONTWRITEBYTECODE says here. How the figures read:
docs/STARTUP.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tokenserve.cache_dir import CACHE_DIR_ENV, cache_root

# Log lines that mark a phase of the start, and the phase they end.
LOG_MARKS = {
    "import": "Engine core process: modules imported.",
    "configured": "Engine core process: configured.",
    "load": "Engine core ready in",
}
PHASES = ("import", "configured", "load", "ready", "first_token", "first_answer")
_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
CHAT_MESSAGE = "Hello! Who are you?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-runs", type=int, default=3,
                        help="Starts to measure, one after another (the first one also warms "
                             "the caches unless --cold).")
    parser.add_argument("--cold", action="store_true",
                        help="Before each run, empty tokenserve's cache directory (converted "
                             "tokenizers, built kernels, expanded weights) and build the "
                             "kernels as the install does: the start right after a fresh "
                             "install.")
    parser.add_argument("--cache-dir", default=None,
                        help=f"The server's ${CACHE_DIR_ENV} (default: this environment's, "
                             f"{cache_root()}).")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="Seconds one run may take before it counts as failed.")
    parser.add_argument("--output-json", default=None, help="Write every run and the summary here.")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="Arguments for `tokenserve serve`, after `--` (e.g. -- MODEL "
                             "--max-model-len 2048).")


@dataclass
class StartupRun:
    """One start, in seconds from the process start (None where the log lacks the mark)."""

    import_s: float | None
    configured_s: float | None  # the engine process has its configuration
    load_s: float | None
    ready_s: float
    first_token_s: float
    first_answer_s: float
    answer: str
    rss_bytes: dict[str, int] = field(default_factory=dict)  # "api", "engine_core", "other"
    install_s: float | None = None  # --cold: the kernel build before the start

    def phase(self, name: str) -> float | None:
        return getattr(self, f"{name}_s")


def log_marks(log_text: str, started_at: float) -> dict[str, float]:
    """Seconds after `started_at` (a time.time()) at which the log shows each LOG_MARKS line
    (the first of each; log times are local, at millisecond resolution)."""
    marks: dict[str, float] = {}
    for line in log_text.splitlines():
        for name, text in LOG_MARKS.items():
            if name in marks or text not in line:
                continue
            found = _LOG_TIME.search(line)
            if found is not None:
                stamp = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")
                marks[name] = stamp.timestamp() - started_at
    return marks


def summarize(runs: list[StartupRun]) -> dict[str, Any]:
    """Median, min and max of each phase and of the total RSS over the runs."""
    summary: dict[str, Any] = {"num_runs": len(runs)}
    for name in PHASES:
        values = [v for v in (run.phase(name) for run in runs) if v is not None]
        if values:
            summary[f"{name}_s"] = {
                "median": statistics.median(values), "min": min(values), "max": max(values)
            }
    for part in ("api", "engine_core", "total"):
        values = [
            sum(run.rss_bytes.values()) if part == "total" else run.rss_bytes.get(part, 0)
            for run in runs
        ]
        summary[f"rss_{part}_bytes"] = statistics.median(values) if values else 0
    installs = [run.install_s for run in runs if run.install_s is not None]
    if installs:
        summary["install_s"] = statistics.median(installs)
    return summary


def format_report(summary: dict[str, Any], cold: bool) -> str:
    labels = {
        "import": "engine modules imported",
        "configured": "engine configuration built",
        "load": "engine core ready (model loaded)",
        "ready": "/health 200",
        "first_token": "first token of the chat answer",
        "first_answer": "whole chat answer (8 tokens)",
    }
    kind = "cold (cache emptied)" if cold else "warm"
    title = (f"tokenserve bench startup: {summary['num_runs']} {kind} run(s), seconds after "
             "`tokenserve serve` started (median, min-max)")
    lines = [title]
    for name in PHASES:
        figure = summary.get(f"{name}_s")
        if figure is not None:
            lines.append(f"  {labels[name]:37s} {figure['median']:6.2f}  "
                         f"({figure['min']:.2f}-{figure['max']:.2f})")
    if "install_s" in summary:
        lines.append(f"  {'kernel build (install step)':37s} {summary['install_s']:6.2f}")
    mib = 1024**2
    lines.append(
        f"  RSS after the answer: API {summary['rss_api_bytes'] / mib:.0f} MiB + engine core "
        f"{summary['rss_engine_core_bytes'] / mib:.0f} MiB = {summary['rss_total_bytes'] / mib:.0f} "
        "MiB (shared library pages counted in both)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll
    serve_args = [arg for arg in args.serve_args if arg != "--"]
    if args.num_runs < 1:
        raise ValueError(f"--num-runs must be at least 1, got {args.num_runs}.")
    cache_dir = os.path.expanduser(args.cache_dir) if args.cache_dir else cache_root()
    env = server_environment(os.environ, cache_dir)
    runs = []
    for index in range(args.num_runs):
        install_s = _fresh_install(cache_dir, env) if args.cold else None
        result = measure_start(serve_args, env, args.timeout)
        result.install_s = install_s
        runs.append(result)
        print(f"run {index + 1}: ready {result.ready_s:.2f} s, first answer "
              f"{result.first_answer_s:.2f} s: {result.answer!r}", flush=True)
    summary = summarize(runs)
    print(format_report(summary, args.cold))
    report = {"serve_args": serve_args, "cold": args.cold, "cache_dir": cache_dir,
              "runs": [asdict(r) for r in runs], "summary": summary}
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(report, file, indent=2)
    return report


def server_environment(environ: Mapping[str, str], cache_dir: str) -> dict[str, str]:
    """The server's environment: this one with `cache_dir` as its cache directory, and its
    modules' bytecode written and read as an installed package's is (without
    PYTHONDONTWRITEBYTECODE, which some containers set: every start would compile
    tokenserve's modules again)."""
    env = {name: value for name, value in environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    env[CACHE_DIR_ENV] = cache_dir
    return env


def _fresh_install(cache_dir: str, env: dict[str, str]) -> float:
    """Empty the cache directory and build the kernels, as scripts/install.sh does."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tokenserve.kernels"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def measure_start(serve_args: list[str], env: dict[str, str], timeout_s: float) -> StartupRun:
    """One start of `tokenserve serve`, stopped (SIGTERM) once measured."""
    port = _free_port()
    command = [sys.executable, "-m", "tokenserve.entrypoints.cli", "serve",
               "--host", "127.0.0.1", "--port", str(port), *serve_args]
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="tokenserve-startup-", suffix=".log") as log:
        started_at, started = time.time(), time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready_s = _wait_for_health(url, process, started, timeout_s, log.name)
            with httpx.Client(base_url=url, timeout=timeout_s) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                first_token_s, first_answer_s, answer = _stream_chat(client, model, started)
            rss = _rss_by_process(process.pid)
        finally:
            _stop(process)
        log.flush()
        with open(log.name, encoding="utf-8", errors="replace") as file:
            marks = log_marks(file.read(), started_at)
    return StartupRun(marks.get("import"), marks.get("configured"), marks.get("load"), ready_s, first_token_s,
                      first_answer_s, answer, rss)


def _wait_for_health(
    url: str, process: subprocess.Popen, started: float, timeout_s: float, log_path: str
) -> float:
    # One client for every poll: `httpx.get` builds a client, and with it an SSL context,
    # per call (~30 ms of CPU), which polling every 20 ms made a third busy process beside
    # the two being measured on a two-core machine.
    with httpx.Client(trust_env=False) as client:
        while (elapsed := time.perf_counter() - started) < timeout_s:
            if process.poll() is not None:
                with open(log_path, encoding="utf-8", errors="replace") as file:
                    tail = file.read()[-3000:]
                raise RuntimeError(f"tokenserve serve exited ({process.returncode}):\n{tail}")
            try:
                # The server listens before its engine is ready and answers then: a long wait.
                timeout = min(5.0, timeout_s - elapsed)
                if client.get(f"{url}/health", timeout=timeout).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                time.sleep(0.02)
    raise RuntimeError(f"tokenserve serve was not ready within {timeout_s:.0f} s.")


def _stream_chat(client: httpx.Client, model: str, started: float) -> tuple[float, float, str]:
    body = {"model": model, "messages": [{"role": "user", "content": CHAT_MESSAGE}],
            "temperature": 0, "max_tokens": 8, "stream": True}
    first_token_s: float | None = None
    pieces: list[str] = []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first_token_s = first_token_s or time.perf_counter() - started
                    pieces.append(content)
    first_answer_s = time.perf_counter() - started
    return first_token_s or first_answer_s, first_answer_s, "".join(pieces)


def _rss_by_process(pid: int) -> dict[str, int]:
    """Resident bytes of the server (`api`), its engine-core process and any other child."""
    import psutil

    server = psutil.Process(pid)
    rss = {"api": server.memory_info().rss, "engine_core": 0, "other": 0}
    for child in server.children(recursive=True):
        try:
            kind = "engine_core" if "spawn_main" in " ".join(child.cmdline()) else "other"
            rss[kind] += child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return rss


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
