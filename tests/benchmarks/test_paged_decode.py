"""benchmarks/paged_decode.py: the decode kernel timed over blocks in order and scattered.

Timings depend on the host, so only their shape is checked: both block orders reported,
each figure a finite, non-negative number (a fast CPU may time a tiny shape near 0).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "paged_decode.py"
NUMBER = r"([-+\d.eE]+|inf|nan)"


def test_paged_decode_times_both_block_orders():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "3", "--context", "40", "--block-size", "8",
         "--layers", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("3 rows x 40 tokens, block size 8, 2 layers, float32"), (
        result.stdout
    )
    timed = re.findall(
        rf"^\s+blocks (in order|scattered)\s+{NUMBER} ms per step\s+{NUMBER} GB/s$",
        result.stdout, re.MULTILINE,
    )
    assert [name for name, _, _ in timed] == ["in order", "scattered"], result.stdout
    for _, ms, rate in timed:
        for value in (float(ms), float(rate)):
            assert math.isfinite(value) and value >= 0, result.stdout
