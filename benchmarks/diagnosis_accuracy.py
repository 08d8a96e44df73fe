"""Simulator vs reality (docs/DIAGNOSIS.md): each workload as a Mooncake trace, replayed by
`bench serve` against a real `tokenserve serve` and predicted by `tokenserve simulate` with
the same engine settings and one cost.json calibrated just before, in one sitting.

    python benchmarks/diagnosis_accuracy.py --out DIR [--scale 0.5] [--cost-model cost.json]

Writes DIR/<case>.{trace.jsonl,real.json,sim.json}, DIR/cost.json and DIR/report.md (TTFT
p50, TPOT p50, total token throughput: simulated / real - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from tokenserve.benchmarks import mooncake
from tokenserve.metrics.request_trace import TraceEntry

CLI = [sys.executable, "-m", "tokenserve.entrypoints.cli"]
# The tune demo runs after this case (the most telling cases first, the variants after).
TUNE_AFTER = "mixed-shared"
FIGURES = (("ttft_ms", "p50"), ("tpot_ms", "p50"), ("total_token_throughput", None))


def cases(scale: float) -> dict[str, tuple[list[str], list[str]]]:
    """case → (trace flags for make_trace, engine flags for serve and simulate)."""
    n = lambda count: str(max(2, round(count * scale)))
    return {
        "W2-inf": (["--num-prompts", n(64), "--input-len", "256", "--output-len", "64"], []),
        "W3-prefix": (["--dataset", "shared-prefix", "--num-prompts", n(64), "--prefix-len", "1024",
                       "--input-len", "64", "--output-len", "32"], []),
        "W4-budget256": (["--dataset", "mixed", "--num-prompts", str(4 + int(n(32))),
                          "--input-len", "64", "--output-len", "64", "--request-rate", "4"],
                         ["--max-num-batched-tokens", "256"]),
        "W5-kv2048": (["--num-prompts", n(32), "--input-len", "256", "--output-len", "256"],
                      ["--num-kv-blocks", "16"]),
        "mixed-shared": (["mixed-shared", n(48)], []),
        "W2-poisson2": (["--num-prompts", n(64), "--input-len", "256", "--output-len", "64",
                         "--request-rate", "2"], []),
        "W4-budget2048": (["--dataset", "mixed", "--num-prompts", str(4 + int(n(32))),
                           "--input-len", "64", "--output-len", "64", "--request-rate", "4"],
                          ["--max-num-batched-tokens", "2048"]),
        "W5-kv2048-nolookahead": (["--num-prompts", n(32), "--input-len", "256", "--output-len", "256"],
                                  ["--num-kv-blocks", "16", "--admission-lookahead-tokens", "0"]),
    }


def write_mixed_shared_trace(path: Path, count: int, seed: int = 0) -> None:
    """Three system prompts (one or two shared 512-token blocks) under varied requests:
    0-2 blocks of their own plus a partial one, 16-128 tokens out, Poisson 3 req/s."""
    rng = np.random.default_rng(seed)
    prefixes = [[0], [1, 2], [3]]
    times = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / 3.0, size=count - 1))])
    entries = []
    for index in range(count):
        shared = prefixes[int(rng.integers(0, len(prefixes)))]
        own_blocks = int(rng.integers(0, 2))
        tail = int(rng.integers(32, 480))
        own = [1000 + 10 * index + block for block in range(own_blocks + 1)]
        entries.append(TraceEntry(round(times[index] * 1000), 512 * (len(shared) + own_blocks) + tail,
                                  int(rng.integers(16, 129)), shared + own))
    mooncake.write_trace(entries, str(path))


def make_trace(trace: Path, flags: list[str]) -> None:
    if flags[0] == "mixed-shared":
        write_mixed_shared_trace(trace, int(flags[1]))
        return
    subprocess.run([sys.executable, "-m", "tokenserve.benchmarks.make_trace", str(trace), *flags],
                   check=True, stdout=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_real(trace: Path, engine: list[str], out: Path) -> None:
    port = free_port()
    log = open(out.with_suffix(".server.log"), "w")  # noqa: SIM115
    server = subprocess.Popen([*CLI, "serve", "--port", str(port), "--disable-log-stats", *engine],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"server exited: see {log.name}")
            time.sleep(1)
        subprocess.run([*CLI, "bench", "serve", "--port", str(port), "--dataset", "mooncake",
                        "--trace", str(trace), "--ignore-eos", "--output-json", str(out)],
                       check=True, stdout=subprocess.DEVNULL, timeout=900)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        log.close()


def tune_demo(out: Path, cost: Path, scale: float, slo: str) -> None:
    """tune on the W4 trace, then the trace served with the defaults and with the best."""
    trace_flags, _ = cases(scale)["W4-budget256"]
    trace = out / "tune.trace.jsonl"
    subprocess.run([sys.executable, "-m", "tokenserve.benchmarks.make_trace", str(trace),
                    *trace_flags], check=True, stdout=subprocess.DEVNULL)
    if slo == "auto":
        # Half the defaults' simulated ITL p99, with at most half again their TTFT p99.
        baseline = out / "tune.defaults.sim.json"
        subprocess.run([*CLI, "simulate", "--trace", str(trace), "--cost-model", str(cost),
                        "--output-json", str(baseline)], check=True, stdout=subprocess.DEVNULL)
        figures = json.loads(baseline.read_text())["summary"]
        slo = (f"itl_p99<{figures['itl_ms']['p99'] * 0.5:.0f}ms,"
               f"ttft_p99<{figures['ttft_ms']['p99'] * 1.5:.0f}ms")
    tuned = out / "tune.json"
    printed = subprocess.run([*CLI, "tune", "--trace", str(trace), "--cost-model", str(cost),
                              "--slo", slo, "--output-json", str(tuned)],
                             check=True, capture_output=True, text=True).stdout
    (out / "tune.txt").write_text(printed)
    print(printed, flush=True)
    best = json.loads(tuned.read_text())["candidates"][0]["settings"]
    command = printed.strip().splitlines()[-1].split()[2:]  # the flags of `tokenserve serve`
    lines = [f"SLO {slo}", "| run | settings | ttft_p50 | ttft_p99 | itl_p50 | itl_p99 | tok/s |",
             "|---|---|---|---|---|---|---|"]
    for name, engine in (("defaults", []), ("tuned", command)):
        real = out / f"tune.{name}.real.json"
        run_real(trace, engine, real)
        summary = json.loads(real.read_text())["summary"]
        lines.append(f"| {name} | {' '.join(engine) or '-'} | {summary['ttft_ms']['p50']:.0f} | "
                     f"{summary['ttft_ms']['p99']:.0f} | {summary['itl_ms']['p50']:.0f} | "
                     f"{summary['itl_ms']['p99']:.0f} | {summary['total_token_throughput']:.0f} |")
    (out / "tune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), f"(best: {best})", flush=True)


def figure(summary: dict, name: str, key: str | None) -> float:
    return summary[name][key] if key else summary[name]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scale", type=float, default=1.0, help="Fraction of each workload's requests.")
    parser.add_argument("--cost-model", default=None, help="Skip calibration, use this cost.json.")
    parser.add_argument("--only", default=None, help="Comma-separated case names.")
    parser.add_argument("--sim-only", action="store_true",
                        help="Keep the real runs already in --out; simulate their traces again "
                             "(with --cost-model or a fresh calibration) and rewrite the report.")
    parser.add_argument("--tune-slo", default=None,
                        help="Also run `tokenserve tune` on the W4 trace against this SLO ('auto': "
                             "half the defaults' simulated ITL p99 and at most 1.5x their TTFT "
                             "p99) and serve the trace with the defaults and with the best.")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost = Path(args.cost_model) if args.cost_model else out / "cost.json"
    if not args.cost_model:
        subprocess.run([*CLI, "calibrate", "-o", str(cost)], check=True)
    rows = []
    selected = cases(args.scale)
    if args.only:
        selected = {k: v for k, v in selected.items() if k in args.only.split(",")}
    for name, (trace_flags, engine) in selected.items():
        trace = out / f"{name}.trace.jsonl"
        real, sim = out / f"{name}.real.json", out / f"{name}.sim.json"
        if args.sim_only:
            if not real.exists():
                continue
        else:
            make_trace(trace, trace_flags)
            run_real(trace, engine, real)
        subprocess.run([*CLI, "simulate", "--trace", str(trace), "--cost-model", str(cost),
                        "--output-json", str(sim), *engine], check=True, stdout=subprocess.DEVNULL)
        real_summary = json.loads(real.read_text())["summary"]
        sim_summary = json.loads(sim.read_text())["summary"]
        cells = []
        for fig, key in FIGURES:
            r, s = figure(real_summary, fig, key), figure(sim_summary, fig, key)
            cells += [r, s, s / r - 1 if r else float("nan")]
        rows.append((name, cells, real_summary, sim_summary))
        print(name, " ".join(f"{c:.3g}" for c in cells), flush=True)
        write_report(out, rows)
        if args.tune_slo and name == TUNE_AFTER and not args.sim_only:
            tune_demo(out, cost, args.scale, args.tune_slo)
    if args.tune_slo and TUNE_AFTER not in selected and not args.sim_only:
        tune_demo(out, cost, args.scale, args.tune_slo)
    return 0


def write_report(out: Path, rows: list) -> None:
    lines = [("| case | TTFT p50 real / sim (ms) | err | TPOT p50 real / sim (ms) | err | "
             "total tok/s real / sim | err | prefix hit real / sim | preemptions real / sim | sim speed |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c, real_summary, sim_summary in rows:
        hit = lambda s: "-" if s.get("prefix_cache_hit_rate") is None else f"{s['prefix_cache_hit_rate']:.2f}"
        lines.append(
            f"| {name} | {c[0]:.0f} / {c[1]:.0f} | {c[2]:+.0%} | {c[3]:.1f} / {c[4]:.1f} | {c[5]:+.0%} | "
            f"{c[6]:.0f} / {c[7]:.0f} | {c[8]:+.0%} | {hit(real_summary)} / {hit(sim_summary)} | "
            f"{real_summary.get('num_preemptions') or 0:.0f} / {sim_summary['num_preemptions']:.0f} | "
            f"{sim_summary.get('realtime_ratio', 0):.0f}x |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
