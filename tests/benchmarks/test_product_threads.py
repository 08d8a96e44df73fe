"""benchmarks/product_threads.py: a row per shape, packing and row count, with the times on
one thread and on all and their ratio.

Timings depend on the host, so only their shape is checked: finite, positive numbers, the
ratio the quotient of the two times (as rounded).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "product_threads.py"


BF16_PACKING = (torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.skipif(not BF16_PACKING, reason="oneDNN packs no bf16 weights on this CPU")
def test_product_threads_prints_a_row_per_shape_packing_and_row_count():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--shapes", "64x32", "48x64", "--rows", "16", "40",
         "--pack-hints", "none", "1", "--layers", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    number = r"([\d.]+)"
    rows = re.findall(rf"^\s+(\d+x\d+)\s+(\w+)\s+(\d+)\s+{number}\s+{number}\s+{number}$",
                      result.stdout, re.MULTILINE)
    assert [(shape, hint, int(count)) for shape, hint, count, *_ in rows] == [
        (shape, hint, count)
        for shape in ("64x32", "48x64") for hint in ("none", "1") for count in (16, 40)
    ], result.stdout
    for *_, one, many, speedup in rows:
        one, many, speedup = float(one), float(many), float(speedup)
        assert math.isfinite(one) and one > 0 and math.isfinite(many) and many > 0
        # (The times are printed to 0.1 us, the ratio to 0.01.)
        assert speedup == pytest.approx(one / many, rel=0.05, abs=0.01)


@pytest.mark.skipif(BF16_PACKING or not torch.backends.mkldnn.is_available(),
                    reason="oneDNN packs bf16 weights on this CPU")
def test_a_cpu_without_bf16_packing_is_told_so():
    result = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "64x32", "--rows", "16"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0
    assert "oneDNN packs no bf16 weights on this CPU" in result.stderr
