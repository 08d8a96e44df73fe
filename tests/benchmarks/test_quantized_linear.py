"""benchmarks/quantized_linear.py on the default model: all three paths over every weight.

Timings depend on the host, so only their shape is checked: finite, non-negative numbers.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quantized_linear.py"


def test_quantized_linear_times_all_paths_over_the_default_model():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "1", "3", "--few-rows-up-to", "1",
         "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    # 30 layers x 4 projections + the logits matrix.
    assert result.stdout.startswith("121 weights"), result.stdout
    number, cell = r"([\d.]+)", r"([\d.]+|-)"
    rows = re.findall(
        rf"^\s+(\d+)\s+{cell}\s+{number}\s+{number}\s+{cell}\s+{number}$",
        result.stdout, re.MULTILINE,
    )
    assert [int(row[0]) for row in rows] == [1, 3]
    # The few-row kernel only up to --few-rows-up-to rows.
    assert [row[1] == "-" for row in rows] == [False, True]
    figures = [float(value) for row in rows for value in row[1:] if value != "-"]
    assert all(math.isfinite(value) and value >= 0 for value in figures), result.stdout


def test_quantized_linear_refuses_a_model_without_blocks(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--rows", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0
    assert "no weights in a quantized block form" in result.stderr
