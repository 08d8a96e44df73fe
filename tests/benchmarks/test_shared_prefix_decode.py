"""benchmarks/shared_prefix_decode.py: decode rows over a shared prefix, whole contexts
against the shared-prefix path.

Timings depend on the host, so only their shape is checked: both paths and their ratio
reported, each a finite, non-negative number (a fast CPU may time a tiny shape near 0), and
whether the path runs here as the kernel says.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import torch

from tokenserve.kernels import prompt_attention

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "shared_prefix_decode.py"


def test_shared_prefix_decode_times_both_paths():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "9", "--prefix", "32", "--suffix", "5",
         "--others", "2", "--block-size", "16", "--layers", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    ops = prompt_attention.load()
    takes = ops.shared_prefix_path(torch.bfloat16, True, 9, 3, 64, 16)
    assert result.stdout.startswith(
        "9 rows, 32 shared + 5 own positions, 2 rows without the prefix, 2 layers, blocks of "
        "16; shared-prefix path "
        + ("taken" if takes else "not available here (no AMX)")), result.stdout
    figures = re.findall(r"^\s+(whole contexts|shared prefix|ratio)\s+([\d.]+)",
                         result.stdout, re.MULTILINE)
    assert [name for name, _ in figures] == ["whole contexts", "shared prefix", "ratio"]
    for _, value in figures:
        assert math.isfinite(float(value)) and float(value) >= 0, result.stdout


def test_a_prefix_of_part_of_a_block_is_refused():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--prefix", "40", "--block-size", "16"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0 and "whole blocks" in result.stderr
