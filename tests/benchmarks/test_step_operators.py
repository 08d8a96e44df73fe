"""benchmarks/step_operators.py on a tiny model: it times the operators of real steps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_operators.py"


# --prefix-len: W3's shape, the prompts behind one shared prefix.
@pytest.mark.parametrize("prefix_len", [0, 24])
def test_step_operators_times_each_operator_inside_the_forward(tiny_model_dirs, prefix_len):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--num-prompts", "3", "--input-len", "40", "--prefix-len", str(prefix_len),
         "--output-len", "2", "--skip", "0", "--steps", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"^2 steps after 0: [\d.]+ ms of CPU time per step$", result.stdout,
                     re.MULTILINE)
    parts = {name: float(value) for name, value in
             re.findall(r"^  (\S.*?)\s+(-?[\d.]+) ms", result.stdout, re.MULTILINE)}
    operators = ("linear", "attention", "rms_norm", "silu_and_mul", "rotary", "embedding",
                 "oneDNN product")
    for name in (*operators, "logits", "model_forward", "rest of the forward",
                 "linear minus oneDNN"):
        assert name in parts, result.stdout
    # Each operator ran (a label is printed only once its operator was called in the timed
    # steps), inside the forward pass; the product inside the linear method; the logits'
    # product after the forward, apart. A tiny model's embedding can take under 0.05 ms of
    # CPU, printed as 0.0: presence, not size, says it ran.
    for name in operators:
        assert 0 <= parts[name] <= parts["model_forward"], (name, result.stdout)
    assert parts["oneDNN product"] <= parts["linear"]
