"""benchmarks/step_breakdown.py on a tiny model: it times the parts of real steps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_breakdown.py"


def test_step_breakdown_times_each_part(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--num-prompts", "3", "--input-len", "20", "--output-len", "6", "--skip", "1",
         "--steps", "3"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"^3 steps after 1: [\d.]+ ms per step$", result.stdout, re.MULTILINE)
    parts = dict(re.findall(r"^  (\S.*?)\s+([\d.]+) ms$", result.stdout, re.MULTILINE))
    for part in ("execute_model", "model_forward", "linear", "attention", "sample"):
        assert part in parts, result.stdout
    # The parts nest: the forward pass is inside execute_model.
    assert float(parts["model_forward"]) <= float(parts["execute_model"])
