"""benchmarks/kv_block_reuse.py on a tiny model: rounds of generation, the blocks each
round hands out, and which of them were never written before."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_block_reuse.py"


def run_rounds(model: str, tmp_path: Path, *flags: str) -> list[dict]:
    output = tmp_path / "rounds.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", model, "--kv-cache-memory", "64MiB",
         "--block-size", "16", "--rounds", "3", "--num-prompts", "4", "--input-len", "40",
         "--output-len", "3", "--json", str(output), *flags],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = re.findall(r"^round (\d): [\d.]+ s, \d+ minor page faults, (\d+) KV blocks handed "
                       r"out, (\d+) of them never written before", result.stdout, re.MULTILINE)
    assert [line[0] for line in lines] == ["0", "1", "2"], result.stdout
    rounds = json.loads(output.read_text())["rounds"]
    assert [(str(r["round"]), str(r["blocks_handed_out"]), str(r["blocks_new"]))
            for r in rounds] == lines
    return rounds


def test_without_prefix_caching_later_rounds_write_no_new_blocks(tiny_model_dirs, tmp_path):
    rounds = run_rounds(tiny_model_dirs["llama"], tmp_path, "--no-enable-prefix-caching")
    # 4 requests of 43 tokens: 3 blocks of 16 each, all new in the first round; the same
    # blocks again in the next rounds.
    assert [(r["blocks_handed_out"], r["blocks_new"]) for r in rounds] == [(12, 12), (12, 0),
                                                                            (12, 0)]


def test_with_prefix_caching_new_prompts_keep_the_old_blocks_cached(tiny_model_dirs, tmp_path):
    rounds = run_rounds(tiny_model_dirs["llama"], tmp_path)
    # Each request's two full blocks stay cached (new blocks are taken instead); its
    # partial third block is handed out again.
    assert [(r["blocks_handed_out"], r["blocks_new"]) for r in rounds] == [(12, 12), (12, 8),
                                                                            (12, 8)]


def test_the_idle_warm_up_comes_before_the_rounds_and_changes_no_block(tiny_model_dirs,
                                                                        tmp_path):
    # What an idle server's engine core does first (its warm-up with the heap of a full
    # step, the KV cache's pages): the rounds hand out the same blocks as without it.
    rounds = run_rounds(tiny_model_dirs["llama"], tmp_path, "--no-enable-prefix-caching",
                        "--idle-warm-up", "all")
    assert [(r["blocks_handed_out"], r["blocks_new"]) for r in rounds] == [(12, 12), (12, 0),
                                                                            (12, 0)]
