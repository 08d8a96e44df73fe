"""benchmarks/paged_decode.py: the decode kernel timed over blocks in order and scattered.

Timings depend on the host, so only their shape is checked: every instruction-set level the
host runs, both cache dtypes, both block orders and each prefetch plan asked for reported,
each figure a finite, non-negative number (a fast CPU may time a tiny shape near 0), and the
machine's read rate they are stated against a positive one.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

from tokenserve.kernels import cpu_isa, paged_attention

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "paged_decode.py"
NUMBER = r"([-+\d.eE]+|inf|nan)"


def test_paged_decode_times_both_block_orders():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "3", "--context", "40", "--block-size", "8",
         "--layers", "2", "--repeats", "1", "--prefetch", *paged_attention.DECODE_PREFETCH],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "3 rows x 40 tokens, 9 heads / 3 kv heads x 64, block size 8, 2 layers, "
    ), result.stdout
    timed = re.findall(
        rf"^\s+(\S+)\s+(float32|bfloat16)\s+blocks (in order|scattered)\s+(\w+)\s+{NUMBER} ms "
        rf"per step"
        rf"\s+{NUMBER} GB/s \(\s*{NUMBER} of the read rate\)\s+cpu\s+{NUMBER} ms$",
        result.stdout, re.MULTILINE,
    )
    assert [row[:4] for row in timed] == [
        (level, dtype, order, plan)
        for level in cpu_isa.supported_levels()
        for dtype in ("float32", "bfloat16")
        for order in ("in order", "scattered")
        for plan in paged_attention.DECODE_PREFETCH
    ], result.stdout
    read = re.search(rf"torch.sum reads 512 MiB at {NUMBER} GB/s$", result.stdout.splitlines()[0])
    assert read and math.isfinite(float(read[1])) and float(read[1]) > 0, result.stdout
    for *_, ms, rate, share, cpu_ms in timed:
        for value in (float(ms), float(rate), float(share), float(cpu_ms)):
            assert math.isfinite(value) and value >= 0, result.stdout


def test_paged_decode_times_another_tree_in_turns():
    """--other-csrc: each case again on another tree's build (here this tree's own sources),
    "other" after the level, with its outputs compared bit for bit to this build's."""
    csrc = Path(paged_attention.__file__).resolve().parent / "csrc"
    level = cpu_isa.supported_levels()[0]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "3", "--context", "40", "--block-size", "8",
         "--layers", "2", "--repeats", "1", "--kv-cache-dtype", "float32", "--cpu-isa", level,
         "--other-csrc", str(csrc)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [row[:2] for row in rows] == [
        [level, "float32"], [level, "other"], [level, "float32"], [level, "other"]
    ], result.stdout
    assert [" ".join(row[-2:]) for row in rows[1::2]] == ["same bits"] * 2, result.stdout
