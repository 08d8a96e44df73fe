"""The table of benchmarks/data_parallel.sh: DP=1 and DP=2 side by side per figure and repeat.

    python benchmarks/data_parallel_report.py OUT [REPEATS]     # Markdown on stdout
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

Figure = Callable[[dict[str, Any]], "float | list[float]"]


def _ms_to_s(distribution: dict[str, float], keys: tuple[str, ...]) -> list[float]:
    return [distribution[key] / 1e3 for key in keys]


ROWS: list[tuple[str, str, Figure]] = [
    ("W1 output tok/s", "w1", lambda s: s["output_throughput"]),
    ("W1 total tok/s", "w1", lambda s: s["total_token_throughput"]),
    ("W1 wall s", "w1", lambda s: s["duration_s"]),
    ("W1 TTFT mean / p99 s", "w1", lambda s: _ms_to_s(s["ttft_ms"], ("mean", "p99"))),
    ("W1 TPOT mean ms", "w1", lambda s: s["tpot_ms"]["mean"]),
]
for _name, _label in (("w2_inf", "W2 inf"), ("w2_rate2", "W2 2 req/s")):
    ROWS += [
        (f"{_label}: req/s", _name, lambda s: s["request_throughput"]),
        (f"{_label}: output tok/s", _name, lambda s: s["output_throughput"]),
        (f"{_label}: TTFT mean / p50 / p99 s", _name,
         lambda s: _ms_to_s(s["ttft_ms"], ("mean", "p50", "p99"))),
        (f"{_label}: TPOT mean ms", _name, lambda s: s["tpot_ms"]["mean"]),
        (f"{_label}: ITL mean / p99 ms", _name, lambda s: [s["itl_ms"]["mean"], s["itl_ms"]["p99"]]),
    ]


def _as_list(values: float | list[float]) -> list[float]:
    return values if isinstance(values, list) else [values]


def _format(values: float | list[float]) -> str:
    return " / ".join(f"{v:,.1f}" if v >= 10 else f"{v:.3g}" for v in _as_list(values))


def _ratio(one: float | list[float], two: float | list[float]) -> str:
    return " / ".join(f"{b / a:.2f}" if a else "-" for a, b in zip(_as_list(one), _as_list(two)))


def report(out: str, repeats: int) -> str:
    lines = [
        "| figure | repeat | DP=1 (2 threads) | DP=2 (1 thread each) | DP=2 / DP=1 |",
        "|---|---|---|---|---|",
    ]
    for label, workload, pick in ROWS:
        for rep in range(1, repeats + 1):
            try:
                with open(f"{out}/dp1_{rep}_{workload}.json") as file:
                    one = pick(json.load(file)["summary"])
                with open(f"{out}/dp2_{rep}_{workload}.json") as file:
                    two = pick(json.load(file)["summary"])
            except (OSError, KeyError, TypeError):
                continue
            lines.append(f"| {label} | {rep} | {_format(one)} | {_format(two)} | {_ratio(one, two)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))
