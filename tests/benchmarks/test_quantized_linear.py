"""benchmarks/quantized_linear.py on the default model: both paths over every weight."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quantized_linear.py"


def test_quantized_linear_times_both_paths_over_the_default_model():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "1", "3", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    # 30 layers x 4 projections + the logits matrix.
    assert result.stdout.startswith("121 weights"), result.stdout
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.MULTILINE)
    assert [int(row[0]) for row in rows] == [1, 3]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_quantized_linear_refuses_a_model_without_blocks(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--rows", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0
    assert "no weights in a quantized block form" in result.stderr
