"""benchmarks/prompt_step_cost.py on a tiny model: one prompt step and one decode step per
prompt length, timed for real, alone and beside requests that decode."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prompt_step_cost.py"


@pytest.mark.parametrize("running", [0, 2])
def test_prompt_step_cost_prints_a_row_per_length(tiny_model_dirs, running):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--lengths", "3,17", "--repeats", "2", "--running", str(running)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.MULTILINE)
    assert [int(length) for length, _, _, _ in rows] == [3, 17], result.stdout
    # Each prompt step carried the prompt and one decode row per running request.
    assert [int(step_rows) for _, step_rows, _, _ in rows] == [3 + running, 17 + running]


def test_a_single_repeat_is_refused(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0 and "--repeats must be at least 2" in result.stderr
