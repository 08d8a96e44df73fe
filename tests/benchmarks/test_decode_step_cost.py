"""benchmarks/decode_step_cost.py on a tiny model: decode steps of each batch size, timed for
real, with every row running."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_step_cost.py"


def test_decode_step_cost_prints_a_row_per_batch(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--batches", "1,5", "--input-len", "40", "--steps", "3", "--cpu-time"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.MULTILINE)
    assert [int(batch) for batch, _, _ in rows] == [1, 5], result.stdout
    assert all(float(median) >= float(fastest) > 0 for _, median, fastest in rows)


def test_a_batch_of_zero_is_refused(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--batches", "0"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0 and "at least 1" in result.stderr
