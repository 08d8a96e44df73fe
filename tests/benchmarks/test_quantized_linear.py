"""benchmarks/quantized_linear.py on the default model: all three paths over every weight, and
with --dtype bfloat16 the bf16 block kernel against oneDNN.

Timings depend on the host, so only their shape is checked: finite, non-negative numbers.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenserve.kernels import cpu_isa

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


def test_quantized_linear_times_the_bf16_block_kernel_against_onednn():
    # A bf16 model where the CPU computes bf16 natively: its block kernel's column (AMX or
    # vdpbf16ps) beside oneDNN's, projections and logits apart.
    level = cpu_isa.resolve(None)
    if not cpu_isa.native_bf16(level):
        pytest.skip(f"no bf16 block kernel on the {level} level")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dtype", "bfloat16", "--rows", "1", "3",
         "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    name = "AMX" if level == "amx" else "vdpbf16ps"
    assert f"{name} proj" in result.stdout and f"{name} logits" in result.stdout, result.stdout
    number = r"([\d.]+)"
    rows = re.findall(rf"^\s+(\d+)" + rf"\s+{number}" * 6 + "$", result.stdout, re.MULTILINE)
    assert [int(row[0]) for row in rows] == [1, 3], result.stdout
    figures = [float(value) for row in rows for value in row[1:]]
    assert all(math.isfinite(value) and value > 0 for value in figures), result.stdout
    if level == "avx512_bf16":
        # Then both vdpbf16ps forms on the projections, row by row.
        assert "vdpbf16ps forms, projections (DP_FEW_ROWS = " in result.stdout, result.stdout
        forms = re.findall(rf"^\s+(\d+)" + rf"\s+{number}" * 3 + "$", result.stdout,
                           re.MULTILINE)
        assert [int(row[0]) for row in forms] == [1, 3], result.stdout
        dot, panel, ratio = (float(value) for value in forms[1][1:])
        # Printed to 0.1 ms, the ratio of the unrounded times to 0.01.
        slack = 0.005 + 0.05 / panel + 0.05 * dot / panel**2 + 1e-9
        assert dot > 0 and panel > 0 and abs(ratio - dot / panel) <= slack
