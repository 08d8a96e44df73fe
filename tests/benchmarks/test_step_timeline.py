"""benchmarks/step_timeline.py on a tiny model: every step's composition, and the TTFTs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_timeline.py"


def test_step_timeline_prints_each_step_and_every_first_token(tiny_model_dirs):
    # Five requests sharing a 32-token prefix, 8 tokens of their own each, at a budget of 64
    # tokens: the first step holds the prefix and the requests the budget leaves room for.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--block-size", "16", "--num-prompts", "5", "--prefix-len", "32",
         "--input-len", "8", "--output-len", "3", "--max-num-batched-tokens", "64",
         "--steps", "50"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = [tuple(map(float, match)) for match in re.findall(
        r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$",
        result.stdout, re.MULTILINE)]
    steps, ends, _, decode, prompt, admitted, firsts = (list(column) for column in zip(*rows))
    assert steps == list(range(len(rows)))
    assert ends == sorted(ends)
    # Every request admitted once and its first token once; each step within the budget.
    assert sum(admitted) == 5 and sum(firsts) == 5
    assert all(d + p <= 64 for d, p in zip(decode, prompt))
    # The prefix is computed once: 40 tokens for the first request, 8 for each other
    # (those admitted with it in the first step read the prefix from the same blocks).
    assert sum(prompt) == 40 + 4 * 8
    assert prompt[0] == 64 and admitted[0] == 4
    # Each request's 3 tokens: the first from its prompt step, two from decode rows.
    assert sum(decode) == 5 * 2
    summary = re.search(r"^(\d+) steps in [\d.]+ s; TTFT s: mean [\d.]+, p50 [\d.]+, "
                        r"p99 [\d.]+$", result.stdout, re.MULTILINE)
    assert summary and int(summary.group(1)) == len(rows), result.stdout
