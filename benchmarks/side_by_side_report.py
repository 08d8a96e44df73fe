"""Summarize a run_side_by_side.sh folder: one markdown table per workload, engines side by side.

usage: python benchmarks/side_by_side_report.py OUT_DIR

Reads OUT_DIR/<workload>_<engine>.json (written by `tokenserve bench serve`, `tokenserve bench
throughput`, `vllm bench throughput` and llama.cpp's `llama-batched-bench`), prints the tables
and writes OUT_DIR/summary.json. The ratio columns are tokenserve / each peer that ran: vLLM
(float32), vLLM bf16, llama.cpp (F32 weights and KV), llama.cpp F16 (F16 weights and KV); and,
where tokenserve also ran in float32 (engine tokenserve_fp32), tokenserve fp32 / the float32
peers. transformers (`benchmarks/transformers_generate.py`) has W1 only. The header names the CPU
(meta.json's lscpu) and what the host charged for fresh memory at the sitting's start and end
(first_touch_start.json, first_touch_end.json: benchmarks/first_touch.py) and the machine's matmul
ceiling and read rates then (ceilings_start.json, ceilings_end.json: benchmarks/matmul_ceiling.py),
against whose higher ceiling W1's model GFLOP/s are stated; the servers table
gives each server's start time and resident memory (server_<session>_<engine>.json), and
tokenserve's start to a first answer (startup_tokenserve.json, `tokenserve bench startup`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from typing import Any

ENGINES = ("tokenserve", "tokenserve_fp32", "vllm", "vllm_bf16", "transformers", "llamacpp",
           "llamacpp_f16")
NAMES = {"tokenserve": "tokenserve", "tokenserve_fp32": "tokenserve fp32", "vllm": "vLLM",
         "vllm_bf16": "vLLM bf16", "transformers": "transformers", "llamacpp": "llama.cpp",
         "llamacpp_f16": "llama.cpp F16"}
# Engines that get a column only where they have results (the others always have one).
OPTIONAL = ("tokenserve_fp32", "vllm_bf16", "transformers", "llamacpp", "llamacpp_f16")
PEERS = ("vllm", "vllm_bf16", "llamacpp", "llamacpp_f16")
# The ratio columns, (ours, theirs): tokenserve (--dtype auto) against every peer, and
# tokenserve in float32 against the peers that compute in float32.
RATIOS = (*(("tokenserve", peer) for peer in PEERS),
          ("tokenserve_fp32", "vllm"), ("tokenserve_fp32", "llamacpp"))
# The instruction sets the figures depend on, as lscpu / /proc/cpuinfo name them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
W1_OUTPUT_LEN = 128  # vLLM's throughput JSON has no output-token count; W1 fixes it

# A figure: its label, and its path of keys into a `bench serve` summary.
Figure = tuple[str, tuple[str, ...]]

_W2: list[Figure] = [
    ("req/s", ("request_throughput",)),
    ("output tok/s", ("output_throughput",)),
    ("TTFT mean ms", ("ttft_ms", "mean")),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("TPOT mean ms", ("tpot_ms", "mean")),
    ("ITL mean ms", ("itl_ms", "mean")),
    ("ITL p99 ms", ("itl_ms", "p99")),
]
_W3: list[Figure] = [
    ("TTFT mean ms", ("ttft_ms", "mean")),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("req/s", ("request_throughput",)),
    ("prefix-cache hit rate", ("prefix_cache_hit_rate",)),
]
_W4: list[Figure] = [
    ("short TTFT p50 ms", ("groups", "short", "ttft_ms", "p50")),
    ("short TTFT p99 ms", ("groups", "short", "ttft_ms", "p99")),
    ("short ITL p99 ms", ("groups", "short", "itl_ms", "p99")),
    ("long TTFT mean ms", ("groups", "long", "ttft_ms", "mean")),
]
_W5: list[Figure] = [
    ("completed", ("completed",)),
    ("failed", ("failed",)),
    ("preemptions", ("num_preemptions",)),
    ("output tok/s", ("output_throughput",)),
]
# (result name without the engine, its figures), in the order printed.
SERVE_TABLES: list[tuple[str, list[Figure]]] = [
    ("w2_rate_inf", _W2),
    ("w2_rate_2", _W2),
    ("w3_prefix_cache_on", _W3),
    ("w3_prefix_cache_off", _W3),
    *((f"w4_mbt_{mbt}", _W4) for mbt in (256, 512, 2048)),
    ("w5_unconstrained", _W5),
    ("w5_constrained", _W5),
]


def serve_tables(out_dir: str) -> list[tuple[str, list[Figure]]]:
    """SERVE_TABLES, with a table after W2 at 2 req/s for each threshold the run's W2
    sessions w2_lpt_N used (the script's W2_LONG_PREFILL), smallest first."""
    found = {int(match.group(1)) for path in glob.glob(os.path.join(out_dir, "w2_lpt_*.json"))
             if (match := re.fullmatch(r"w2_lpt_(\d+)_rate_2_.+\.json", os.path.basename(path)))}
    tables = list(SERVE_TABLES)
    at = [name for name, _ in tables].index("w2_rate_2") + 1
    tables[at:at] = [(f"w2_lpt_{n}_rate_2", _W2) for n in sorted(found)]
    return tables


def load(out_dir: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(out_dir, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return json.load(file)


def dig(data: dict[str, Any] | None, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(data, dict) or data.get(key) is None:
            return None
        data = data[key]
    return float(data) if isinstance(data, (int, float)) else None


def w1_figures(out_dir: str) -> dict[str, dict[str, float | None]]:
    figures: dict[str, dict[str, float | None]] = {}
    # tokenserve's and transformers_generate.py's JSON share their keys.
    for engine in ("tokenserve", "tokenserve_fp32", "transformers"):
        data = load(out_dir, f"w1_{engine}")
        if data is not None:
            figures[engine] = {
                "output tok/s": data["output_tokens_per_second"],
                "total tok/s": data["total_tokens_per_second"],
                "wall s": data["elapsed_time"],
            }
    for engine in ("vllm", "vllm_bf16"):
        vllm = load(out_dir, f"w1_{engine}")
        if vllm is not None:
            figures[engine] = {
                "output tok/s": vllm["num_requests"] * W1_OUTPUT_LEN / vllm["elapsed_time"],
                "total tok/s": vllm["tokens_per_second"],
                "wall s": vllm["elapsed_time"],
            }
    # One line of llama-batched-bench's JSONL: pl sequences of pp prompt and tg output tokens.
    for engine in ("llamacpp", "llamacpp_f16"):
        llama = load(out_dir, f"w1_{engine}")
        if llama is not None:
            figures[engine] = {
                "output tok/s": llama["pl"] * llama["tg"] / llama["t"],
                "total tok/s": llama["speed"],
                "wall s": llama["t"],
            }
    return figures


def ceilings(out_dir: str) -> dict[str, dict[str, Any]]:
    """benchmarks/matmul_ceiling.py's JSON at the sitting's start and end, where measured."""
    found = {when: load(out_dir, f"ceilings_{when}") for when in ("start", "end")}
    return {when: data for when, data in found.items() if data is not None}


def add_w1_ceiling_rows(figures: dict[str, dict[str, float | None]],
                        measured: dict[str, dict[str, Any]]) -> None:
    """Each engine's W1 model GFLOP/s (every token through the layers' products, a logits row
    per output token: the FLOPs per token matmul_ceiling.py wrote) and its fraction of the
    machine's matmul ceiling, the highest of any dtype at the start or the end."""
    if not measured:
        return
    any_one = next(iter(measured.values()))
    layer, logits = any_one["layer_flops_per_token"], any_one["logits_flops_per_row"]
    ceiling = max(rate for data in measured.values() for rate in data["ceiling_gflops"].values())
    for row in figures.values():
        total, output = row["total tok/s"], row["output tok/s"]
        if total is None or output is None:
            continue
        gflops = (layer * total + logits * output) / 1e9
        row["model GFLOP/s"] = gflops
        row["of the matmul ceiling"] = gflops / ceiling


def ceilings_line(measured: dict[str, dict[str, Any]]) -> str | None:
    """The machine's matmul ceiling per dtype and read rates at the start and end."""
    parts = []
    for when, data in measured.items():
        gemm = ", ".join(f"{dtype} {rate:.0f}" for dtype, rate in data["ceiling_gflops"].items())
        reads = ", ".join(f"{rate:.1f} over {mib} MiB"
                          for mib, rate in (data.get("read_gb_per_s") or {}).items())
        parts.append(f"{when} {gemm} GFLOP/s" + (f"; read GB/s {reads}" if reads else ""))
    if not parts:
        return None
    return ("Matmul ceiling on M0's shapes and read rates (benchmarks/matmul_ceiling.py): "
            + "; ".join(parts))


def server_figures(out_dir: str) -> dict[str, dict[str, float | None]]:
    """Each engine's server in its main session (else its first): seconds to /health, RSS,
    peak RSS and (sittings since it was recorded) PSS in MiB; tokenserve's `bench startup`
    medians beside them."""
    figures: dict[str, dict[str, float | None]] = {}
    names = sorted(
        name[: -len(".json")] for name in os.listdir(out_dir)
        if name.startswith("server_") and name.endswith(".json")
    )
    for engine in ENGINES:
        mine = [name for name in names if name.endswith(f"_{engine}")]  # server_<session>_<engine>
        if not mine:
            continue
        data = load(out_dir, next((n for n in mine if n.startswith("server_main_")), mine[0]))
        assert data is not None
        ready = data.get("ready_s")
        figures[engine] = {
            "server ready s": float(ready) if isinstance(ready, (int, float)) else None,
            "RSS MiB": data["rss_kib"] / 1024,
            "peak RSS MiB": data["peak_rss_kib"] / 1024,
        }
        if "pss_kib" in data:
            figures[engine]["PSS MiB"] = data["pss_kib"] / 1024
    startup = load(out_dir, "startup_tokenserve")
    if startup is not None:
        summary = startup["summary"]
        row = figures.setdefault("tokenserve", {})
        for label, key in (("start: /health 200 s", "ready_s"),
                           ("start: first answer s", "first_answer_s")):
            if key in summary:
                row[label] = summary[key]["median"]
    return figures


def cpu_line(meta: dict[str, Any]) -> str:
    """The CPU a sitting ran on: lscpu's model name, its CPUs, and the ISA flags that matter."""
    lscpu = meta.get("lscpu") or {}
    model = lscpu.get("Model name") or meta.get("model name") or "unknown CPU"
    flags = set((lscpu.get("Flags") or meta.get("flags") or "").split())
    isa = [flag for flag in ISA_FLAGS if flag in flags]
    cpus = lscpu.get("CPU(s)") or meta.get("nproc") or "?"
    return f"CPU: {model}, {cpus} CPU(s); {', '.join(isa) or 'none of ' + ', '.join(ISA_FLAGS)}"


def first_touch_line(out_dir: str) -> str | None:
    """What the host charged for fresh memory at the sitting's start and end
    (benchmarks/first_touch.py's JSON files), or None where neither was measured."""
    parts = []
    for when in ("start", "end"):
        data = load(out_dir, f"first_touch_{when}")
        if data is not None:
            chunks = data["first_touch_us_per_page"]
            gib = len(chunks) * data["chunk_mib"] / 1024
            parts.append(f"{when} {min(chunks):.2f}-{max(chunks):.2f} us a page over {gib:g} GiB")
    if not parts:
        return None
    return "Fresh memory, first write (benchmarks/first_touch.py): " + "; ".join(parts)


def w5_outputs_equal(out_dir: str, engine: str) -> str | None:
    """How many constrained-cache outputs equal the unconstrained run's, as 'k/n'."""
    constrained = load(out_dir, f"w5_constrained_{engine}")
    free = load(out_dir, f"w5_unconstrained_{engine}")
    if constrained is None or free is None:
        return None
    pairs = list(zip(constrained["requests"], free["requests"]))
    equal = sum(a["success"] and b["success"] and a["text"] == b["text"] for a, b in pairs)
    return f"{equal}/{len(pairs)}"


def table(title: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    engines = [engine for engine in ENGINES if engine in rows or engine not in OPTIONAL]
    pairs = [(ours, theirs) for ours, theirs in RATIOS if ours in engines and theirs in engines]
    header = " | ".join(NAMES[engine] for engine in engines)
    ratios = " | ".join(f"{NAMES[ours]} / {NAMES[theirs]}" for ours, theirs in pairs)
    lines = [f"### {title}", "", f"| figure | {header} | {ratios} |",
             "|---|" + "---|" * (len(engines) + len(pairs))]
    labels = list(dict.fromkeys(label for values in rows.values() for label in values))
    for label in labels:
        values = {engine: rows.get(engine, {}).get(label) for engine in engines}
        cells = " | ".join(_cell(values[engine]) for engine in engines)
        shares = " | ".join(
            _cell(_ratio(values[ours], values[theirs]), ".2f") for ours, theirs in pairs
        )
        lines.append(f"| {label} | {cells} | {shares} |")
    return [*lines, ""]


def _ratio(ours: Any, theirs: Any) -> float | None:
    if isinstance(ours, float) and isinstance(theirs, float) and theirs:
        return ours / theirs
    return None


def main(out_dir: str) -> int:
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    w1 = w1_figures(out_dir)
    measured = ceilings(out_dir)
    add_w1_ceiling_rows(w1, measured)
    if w1:
        summary["w1"] = w1
    for name, fields in serve_tables(out_dir):
        rows = {}
        for engine in ENGINES:
            data = load(out_dir, f"{name}_{engine}")
            if data is not None:
                rows[engine] = {label: dig(data["summary"], path) for label, path in fields}
        if rows:
            summary[name] = rows
    for engine in ENGINES:
        equal = w5_outputs_equal(out_dir, engine)
        if equal is not None:
            summary.setdefault("w5_constrained", {}).setdefault(engine, {})[
                "outputs equal to unconstrained"
            ] = equal

    servers = server_figures(out_dir)
    if servers:
        summary["servers"] = servers
    meta = load(out_dir, "meta") or {}
    brief = {key: value for key, value in meta.items() if key not in ("lscpu", "flags")}
    lines = [f"## Side by side: {out_dir}", "", cpu_line(meta), ""]
    fresh = first_touch_line(out_dir)
    if fresh is not None:
        lines += [fresh, ""]
    limits = ceilings_line(measured)
    if limits is not None:
        lines += [limits, ""]
    lines += [f"meta: {json.dumps(brief)}", ""]
    for name, rows in summary.items():
        lines += table(name, rows)
    print("\n".join(lines))
    with open(os.path.join(out_dir, "summary.json"), "w") as file:
        json.dump(summary, file, indent=2)
    return 0


def _cell(value: Any, spec: str | None = None) -> str:
    """A table cell: 1 decimal from 10 up, 3 significant digits below, unless `spec` says."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec or (".1f" if abs(value) >= 10 else ".3g"))
    return str(value)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
