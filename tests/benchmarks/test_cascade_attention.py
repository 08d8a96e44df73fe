"""benchmarks/cascade_attention.py: cascade and chunk-by-chunk attention timed side by side."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cascade_attention.py"


def test_cascade_attention_times_both_ways_with_the_same_outputs():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--prefix-lens", "800", "--chunks", "2", "3",
         "--chunk-len", "8", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(
        r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$",
        result.stdout, re.MULTILINE,
    )
    assert [(prefix, chunks) for prefix, chunks, *_ in rows] == [("800", "2"), ("800", "3")]
    for *_, plain, cascade, _, difference in rows:
        assert float(plain) > 0 and float(cascade) > 0
        assert float(difference) < 1e-5
