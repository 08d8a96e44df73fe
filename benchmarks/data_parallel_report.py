"""The table of benchmarks/data_parallel.sh: the layouts side by side per figure and repeat,
each also as a ratio to the first layout.

    python benchmarks/data_parallel_report.py OUT [REPEATS [LAYOUT ...]]   # Markdown on stdout

LAYOUTS default to dp1 dp2 (DP=1, 2 threads; DP=2, 1 thread each).
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


_LABELS = {"dp1": "DP=1 (2 threads)", "tp1": "TP=1 (2 threads)", "pp1": "PP=1 (2 threads)"}


def _label(layout: str) -> str:
    kind, size = layout[:2].upper(), layout[2:]
    return _LABELS.get(layout, f"{kind}={size} (1 thread per {'engine' if kind == 'DP' else 'rank'})")


def report(out: str, repeats: int, layouts: list[str]) -> str:
    base, others = layouts[0], layouts[1:]
    lines = [
        "| figure | repeat | " + " | ".join(_label(layout) for layout in layouts) + " | "
        + " | ".join(f"{layout} / {base}" for layout in others) + " |",
        "|---|---|" + "---|" * (len(layouts) + len(others)),
    ]
    for label, workload, pick in ROWS:
        for rep in range(1, repeats + 1):
            values = []
            for layout in layouts:
                try:
                    with open(f"{out}/{layout}_{rep}_{workload}.json") as file:
                        values.append(pick(json.load(file)["summary"]))
                except (OSError, KeyError, TypeError):
                    values.append(None)
            if values[0] is None:
                continue
            cells = [_format(v) if v is not None else "-" for v in values]
            ratios = [_ratio(values[0], v) if v is not None else "-" for v in values[1:]]
            lines.append(f"| {label} | {rep} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(
        sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1, sys.argv[3:] or ["dp1", "dp2"]
    ))
