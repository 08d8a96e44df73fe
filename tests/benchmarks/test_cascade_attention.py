"""benchmarks/cascade_attention.py: cascade and chunk-by-chunk attention timed side by side.

Timings depend on the host, so only their shape is checked (finite, non-negative numbers);
the outputs of the two ways must agree.
"""

from __future__ import annotations

import math
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
    for *_, plain, cascade, ratio, difference in rows:
        for value in (float(plain), float(cascade), float(ratio)):
            assert math.isfinite(value) and value >= 0, result.stdout
        assert float(difference) < 1e-5
