"""benchmarks/prompt_attention.py: the prompt-attention kernel against the SDPA path.

Timings depend on the host, so only their shape is checked: every level with native bf16
the host runs (with a float32 cache every level it runs) and every shape reported, each
figure a finite, non-negative number; a host without native bf16 says that bf16 prompt
chunks keep SDPA.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenserve.kernels import cpu_isa

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prompt_attention.py"
NUMBER = r"([-+\d.eE]+|inf|nan)"


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_prompt_attention_benchmark_reports_every_level_and_shape(cache_dtype):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--scale", "0.05", "--repeats", "1",
         "--kv-cache-dtype", cache_dtype],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        f"9 heads / 3 kv heads x 64, block size 16, {cache_dtype} cache, ")
    levels = [level for level in cpu_isa.supported_levels()
              if cache_dtype == "float32" or cpu_isa.native_bf16(level)]
    if not levels:
        assert "prompt chunks keep SDPA" in result.stdout
        return
    timed = re.findall(
        rf"^\s+(\S+)\s+(\S+)\s+\d+ x \S+\s+kernel\s+{NUMBER} ms\s+{NUMBER} GFLOP/s\s+"
        rf"sdpa\s+{NUMBER} ms\s+{NUMBER} GFLOP/s\s+sdpa/kernel\s+{NUMBER}$",
        result.stdout, re.MULTILINE,
    )
    assert [row[:2] for row in timed] == [
        (level, shape) for level in levels
        for shape in (
            "w1", "short", "w3-first", "w3-continue", "w3-tails", "w3-cached", "w4", "w2")
    ], result.stdout
    for *_, kernel_ms, kernel_rate, sdpa_ms, sdpa_rate, ratio in timed:
        for value in (kernel_ms, kernel_rate, sdpa_ms, sdpa_rate, ratio):
            assert math.isfinite(float(value)) and float(value) >= 0, result.stdout


def test_a_shared_prefix_is_the_same_blocks_in_every_chunks_table():
    """--shared-prefix: the whole blocks of the prefix are one set of blocks in every chunk's
    table (as prefix caching makes them), each chunk's own positions in blocks of its own,
    and the new tokens' slots only in those."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import prompt_attention
    finally:
        sys.path.remove(str(SCRIPT.parent))
    args = SimpleNamespace(heads=9, kv_heads=3, head_dim=64, shared_prefix=40)
    chunks = [(8, 50), (16, 60), (4, 20)]  # the last context is shorter than the prefix
    common, _, num_blocks = prompt_attention._step(chunks, 16, args)
    tables = common.block_tables
    # 40 positions: blocks 1 and 2 whole; the last chunk's first 16 context positions.
    assert tables[0][:2] == tables[1][:2] == [1, 2] and tables[2][:1] == [1]
    own = [block for table, (q_len, seq_len) in zip(tables, chunks)
           for block in table[min(2, (seq_len - q_len) // 16):]]
    assert len(own) == len(set(own)) and not {1, 2} & set(own)
    assert num_blocks == 1 + 2 + len(own)
    new_blocks = {slot // 16 for slot in common.slot_mapping.tolist()}
    assert new_blocks <= set(own)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float32"])
def test_another_trees_kernels_run_beside_these(tmp_path, cache_dtype):
    """--other-csrc: a second build (here a copy of this tree's csrc/) takes turns with this
    one's and gets its own column and ratio."""
    levels = [level for level in cpu_isa.supported_levels()
              if cache_dtype == "float32" or cpu_isa.native_bf16(level)]
    if not levels:
        pytest.skip("no level with native bf16: bf16 prompt chunks keep SDPA")
    other = tmp_path / "csrc"
    shutil.copytree(SCRIPT.parents[1] / "tokenserve" / "kernels" / "csrc", other)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--scale", "0.05", "--repeats", "1", "--shapes", "w1",
         "--cpu-isa", levels[-1], "--other-csrc", str(other), "--kv-cache-dtype", cache_dtype],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    row = re.search(
        rf"^\s+{levels[-1]}\s+w1\s+.*other\s+{NUMBER} ms\s+{NUMBER} GFLOP/s\s+"
        rf"sdpa/kernel\s+{NUMBER}\s+other/kernel\s+{NUMBER}$", result.stdout, re.MULTILINE)
    assert row is not None, result.stdout
    assert all(math.isfinite(float(value)) and float(value) > 0 for value in row.groups())
