"""benchmarks/decode_step_cost.py on a tiny model: decode steps of each batch size, timed for
real, with every row running; with `--other-csrc`, on the default model, two builds of the
fused decode layer taking turns, with `--other-bf16-quantized-max-rows` two row limits of
the bf16 block kernel, with `--other-decode-prefetch` two plans of the decode attention's
prefetches, and with `--other-engine-flags` two engines, after the idle warm-up
(`--warm-up`); with `--spin-beside`, beside a spinning process that is gone when it ends."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.kernel_sources import other_kernel_sources
from tokenserve.config import BF16_QUANTIZED_MAX_ROWS_DP
from tokenserve.kernels import build, cpu_isa, paged_attention

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_step_cost.py"


def test_decode_step_cost_prints_a_row_per_batch(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--batches", "1,5", "--input-len", "40", "--steps", "3", "--cpu-time"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.MULTILINE)
    assert [int(batch) for batch, _, _ in rows] == [1, 5], result.stdout
    assert all(float(median) >= float(fastest) > 0 for _, median, fastest in rows)


def test_a_process_spins_beside_the_timed_steps_and_is_gone_after(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--batches", "1,3", "--input-len", "24", "--steps", "3",
         "--spin-beside", "0.2/2"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"^beside: a process spinning 0.2 ms of every 2.0 ms$", result.stdout,
                     re.MULTILINE), result.stdout
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.MULTILINE)
    assert [int(batch) for batch, _, _ in rows] == [1, 3], result.stdout
    spinning = [process for process in psutil.process_iter(["cmdline"])
                if any("busy, period = " in part for part in process.info["cmdline"] or [])]
    assert spinning == []


@pytest.mark.parametrize("value", ["3/2", "0/2", "fast"])
def test_spin_beside_takes_busy_within_period(tiny_model_dirs, value):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--batches", "1",
         "--spin-beside", value],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0 and "--spin-beside" in result.stderr


def test_a_batch_beyond_max_num_seqs_is_refused(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--batches", "1,5", "--max-num-seqs", "4"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0 and "--max-num-seqs of at least that" in result.stderr


def test_a_batch_of_zero_is_refused(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--batches", "0"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0 and "at least 1" in result.stderr


def test_another_trees_fused_layer_takes_turns_with_this_ones(tmp_path):
    # The other tree: this one's sources with a C comment more, so its own build.
    other = other_kernel_sources(tmp_path, "decode_layer.c", "/* the other tree */\n")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--kv-cache-memory", "64MiB", "--batches", "1,3",
         "--input-len", "24", "--steps", "2", "--other-csrc", str(other)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr
    number = r"\s+([\d.]+)"
    rows = re.findall(r"^\s+(\d+)" + number * 5 + "$", result.stdout, re.MULTILINE)
    assert [int(row[0]) for row in rows] == [1, 3], result.stdout
    for _, median, fastest, other_median, other_fastest, ratio in rows:
        assert float(median) >= float(fastest) > 0
        assert float(other_median) >= float(other_fastest) > 0
        # The medians are printed to 0.1 ms, the ratio of the unrounded ones to 0.001.
        this, that = float(median), float(other_median)
        slack = (0.05 / this + 0.05 / that) * this / that + 5e-4
        assert abs(float(ratio) - this / that) <= slack
    (library,) = re.findall(r"^other tree's decode layer: (\S+)$", result.stdout, re.MULTILINE)
    assert library == build.build("decode_layer", source_dir=str(other))
    assert library != build.build("decode_layer")


def test_other_csrc_needs_a_model_with_fused_steps(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"], "--kv-cache-memory",
         "64MiB", "--batches", "1", "--steps", "1", "--other-csrc", build.SOURCE_DIR],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode != 0 and "takes no fused decode steps" in result.stderr


@pytest.mark.skipif(not set(cpu_isa.ISA_LEVELS["avx512_bf16"][0]) <= cpu_isa.cpu_flags(),
                    reason="no AVX512_BF16 on this CPU")
def test_another_bf16_row_limit_takes_turns_with_the_engines():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--kv-cache-memory", "64MiB", "--dtype", "bfloat16",
         "--cpu-isa", "avx512_bf16", "--batches", "20", "--input-len", "24", "--steps", "2",
         "--other-bf16-quantized-max-rows", "16"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(rf"^bf16 block kernel's row limit: {BF16_QUANTIZED_MAX_ROWS_DP}, "
                     r"other: 16$", result.stdout, re.MULTILINE), result.stdout
    rows = re.findall(r"^\s+(\d+)" + r"\s+([\d.]+)" * 5 + "$", result.stdout, re.MULTILINE)
    assert [int(row[0]) for row in rows] == [20], result.stdout


def test_another_bf16_row_limit_needs_a_bf16_block_kernel(tiny_model_dirs):
    command = [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"],
               "--kv-cache-memory", "64MiB", "--batches", "1", "--steps", "1",
               "--other-bf16-quantized-max-rows"]
    result = subprocess.run(command + ["4"], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode != 0 and "no products on a bf16 block kernel" in result.stderr
    result = subprocess.run(command + ["0"], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode != 0 and "at least 1" in result.stderr


def test_another_decode_prefetch_plan_takes_turns_with_the_cpus(tiny_model_dirs):
    command = [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"],
               "--kv-cache-memory", "64MiB", "--batches", "3", "--input-len", "24", "--steps",
               "2", "--other-decode-prefetch", "stream_next_item"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert re.search(rf"^decode prefetch: {paged_attention.decode_prefetch()} \(this CPU's\), "
                     r"other: stream_next_item$", result.stdout, re.MULTILINE), result.stdout
    rows = re.findall(r"^\s+(\d+)" + r"\s+([\d.]+)" * 5 + "$", result.stdout, re.MULTILINE)
    assert [int(row[0]) for row in rows] == [3], result.stdout
    result = subprocess.run(command + ["--other-csrc", build.SOURCE_DIR], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode != 0 and "not with --other-csrc" in result.stderr


def test_another_engine_takes_turns_after_the_warm_up(tiny_model_dirs):
    command = [sys.executable, str(SCRIPT), "--model", tiny_model_dirs["llama"],
               "--kv-cache-memory", "64MiB", "--batches", "1,3", "--input-len", "24",
               "--steps", "2", "--warm-up", "--other-engine-flags=--no-weight-huge-pages"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^other engine: this one's arguments and --no-weight-huge-pages$",
                     result.stdout, re.MULTILINE), result.stdout
    rows = re.findall(r"^\s+(\d+)" + r"\s+([\d.]+)" * 5 + "$", result.stdout, re.MULTILINE)
    assert [int(row[0]) for row in rows] == [1, 3], result.stdout
    result = subprocess.run(command + ["--other-decode-prefetch", "stream_next_item"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0 and "not with another --other-* option" in result.stderr
