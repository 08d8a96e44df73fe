"""Summarize benchmarks/spec_decode_w6.sh: per batch size and mode, the median over rounds
of the mean TPOT, output tokens/s, and the speedup against speculation off (same rounds).

    python benchmarks/spec_decode_w6_report.py /tmp/w6
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main(directory: str) -> None:
    runs: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for path in sorted(Path(directory).glob("w6_b*_r*.json")):
        batch, rest = path.stem[len("w6_b"):].split("_", 1)
        mode = rest.rsplit("_r", 1)[0]
        runs[int(batch), mode].append(json.loads(path.read_text()))
    print("| batch | mode | rounds | TPOT ms (median) | output tok/s | TPOT speedup | "
          "acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|---|")
    for (batch, mode), results in sorted(runs.items()):
        tpot = statistics.median(r["mean_tpot_ms"] for r in results)
        rate = statistics.median(r["output_tokens_per_second"] for r in results)
        base = runs.get((batch, "off"))
        speedup = statistics.median(r["mean_tpot_ms"] for r in base) / tpot if base else None
        spec = results[0].get("spec_decode")
        acceptance = (
            f"{sum(r['spec_decode']['acceptance_rate'] for r in results) / len(results):.3f}"
            if spec else "-"
        )
        length = (
            f"{sum(r['spec_decode']['mean_acceptance_length'] for r in results) / len(results):.2f}"
            if spec else "-"
        )
        print(f"| {batch} | {mode} | {len(results)} | {tpot:.1f} | {rate:.1f} | "
              f"{speedup:.2f}x | {acceptance} | {length} |" if speedup else "")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/w6")
