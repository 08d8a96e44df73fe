"""benchmarks/prompt_step_cost.py on a tiny model: one prompt step and one decode step per
prompt length, timed for real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prompt_step_cost.py"


def test_prompt_step_cost_prints_a_row_per_length(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--lengths", "3,17", "--repeats", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.MULTILINE)
    assert [int(length) for length, _, _ in rows] == [3, 17], result.stdout
    assert all(float(prompt) > 0 and float(decode) > 0 for _, prompt, decode in rows)


def test_a_single_repeat_is_refused(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0 and "--repeats must be at least 2" in result.stderr
