"""benchmarks/first_touch.py: microseconds per page of fresh memory's first write, by chunk.

Timings depend on the host, so only their shape is checked: a row per chunk from the start
of the mapping, finite positive figures, the median of the chunks' figures, and the same
figures in the JSON file.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "first_touch.py"


def test_first_touch_reports_each_chunk_and_writes_the_json(tmp_path: Path):
    output = tmp_path / "first_touch.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--gib", str(24 / 1024), "--chunk-mib", "8",
         "--json", str(output)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)$", result.stdout, re.MULTILINE)
    assert [int(start) for start, _ in rows] == [0, 8, 16], result.stdout
    data = json.loads(output.read_text())
    assert data["page_bytes"] == mmap.PAGESIZE and data["chunk_mib"] == 8
    first = data["first_touch_us_per_page"]
    assert len(first) == 3
    assert all(math.isfinite(us) and us > 0 for us in first + [data["resident_us_per_page"]])
    assert data["first_touch_median_us_per_page"] == statistics.median(first)
    # The printed rows are the JSON's figures, to 0.01 us.
    assert [float(us) for _, us in rows] == [round(us, 2) for us in first]
    assert f"median {statistics.median(first):.2f} us/page" in result.stdout


def test_first_touch_refuses_an_empty_size():
    result = subprocess.run([sys.executable, str(SCRIPT), "--gib", "0"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "--gib and --chunk-mib must be positive" in result.stderr
