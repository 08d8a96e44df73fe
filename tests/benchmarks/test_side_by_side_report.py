"""benchmarks/side_by_side_report.py on hand-made result files of both engines."""

from __future__ import annotations

import json

from tests.benchmarks.scripts import load_script


def load_report_script():
    return load_script("side_by_side_report")


# W1 as `tokenserve bench throughput --output-json` and vLLM's own `bench throughput` write it.
W1_TOKENSERVE = {"output_tokens_per_second": 100.0, "total_tokens_per_second": 300.0,
                 "elapsed_time": 80.0}
W1_VLLM = {"num_requests": 64, "elapsed_time": 40.96, "tokens_per_second": 600.0,
           "requests_per_second": 1.5625}


def serve_result(output_throughput: float, texts: list[str]) -> dict:
    latency = {"mean": 10.0, "p50": 9.0, "p90": 12.0, "p99": 20.0}
    return {
        "summary": {"completed": len(texts), "failed": 0, "num_preemptions": 3,
                    "output_throughput": output_throughput, "request_throughput": 1.0,
                    "ttft_ms": latency, "tpot_ms": latency, "itl_ms": latency, "e2el_ms": latency},
        "requests": [{"success": True, "text": text} for text in texts],
    }


def write_results(out_dir, files: dict[str, dict]) -> None:
    """Each result as the script leaves it: OUT/<name>.json."""
    for name, data in files.items():
        (out_dir / f"{name}.json").write_text(json.dumps(data))


def test_report_puts_engines_side_by_side(tmp_path, capsys):
    files = {
        "w1_tokenserve": W1_TOKENSERVE,
        "w1_vllm": W1_VLLM,
        "w5_unconstrained_tokenserve": serve_result(50.0, ["a", "b"]),
        "w5_constrained_tokenserve": serve_result(40.0, ["a", "x"]),
        "w5_unconstrained_vllm": serve_result(80.0, ["a", "b"]),
        "w5_constrained_vllm": serve_result(100.0, ["a", "b"]),
    }
    write_results(tmp_path, files)

    assert load_report_script().main(str(tmp_path)) == 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["w1"]["vllm"]["output tok/s"] == 64 * 128 / 40.96
    assert summary["w5_constrained"]["tokenserve"]["outputs equal to unconstrained"] == "1/2"
    assert summary["w5_constrained"]["vllm"]["outputs equal to unconstrained"] == "2/2"
    assert summary["w5_constrained"]["vllm"]["preemptions"] == 3
    printed = capsys.readouterr().out
    assert "| total tok/s | 300.0 | 600.0 | 0.50 |" in printed
    assert "| output tok/s | 40.0 | 100.0 | 0.40 |" in printed


def test_report_adds_llama_cpp_and_its_ratio_where_it_ran(tmp_path, capsys):
    files = {
        "w1_tokenserve": {"output_tokens_per_second": 100.0, "total_tokens_per_second": 300.0,
                          "elapsed_time": 80.0},
        "w1_vllm": {"num_requests": 64, "elapsed_time": 40.96, "tokens_per_second": 600.0},
        # the last line of llama-batched-bench's --output-format jsonl
        "w1_llamacpp": {"pp": 256, "tg": 128, "pl": 64, "t": 160.0, "speed": 153.6},
        "w2_rate_inf_tokenserve": serve_result(50.0, ["a"]),
        "w2_rate_inf_llamacpp": serve_result(25.0, ["a"]),
    }
    write_results(tmp_path, files)

    assert load_report_script().main(str(tmp_path)) == 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["w1"]["llamacpp"]["output tok/s"] == 64 * 128 / 160.0
    printed = capsys.readouterr().out
    assert (
        "| figure | tokenserve | vLLM | llama.cpp | tokenserve / vLLM | tokenserve / llama.cpp |"
        in printed
    )
    assert "| total tok/s | 300.0 | 600.0 | 153.6 | 0.50 | 1.95 |" in printed
    # vLLM has no W2 result here: its cells and ratio are dashes, llama.cpp's ratio is not.
    assert "| output tok/s | 50.0 | - | 25.0 | - | 2.00 |" in printed


def test_report_names_the_cpu_and_puts_every_peer_configuration_and_server_beside(
    tmp_path, capsys
):
    files = {
        "meta": {"nproc": 2, "lscpu": {"Model name": "Intel(R) Xeon(R) Processor", "CPU(s)": "2",
                                       "Flags": "fpu sse avx2 avx512f avx512_bf16 amx_tile"}},
        "w1_tokenserve": {"output_tokens_per_second": 100.0, "total_tokens_per_second": 300.0,
                          "elapsed_time": 80.0},
        "w1_vllm": {"num_requests": 64, "elapsed_time": 40.96, "tokens_per_second": 600.0},
        "w1_vllm_bf16": {"num_requests": 64, "elapsed_time": 20.48, "tokens_per_second": 1200.0},
        "w1_llamacpp": {"pp": 256, "tg": 128, "pl": 64, "t": 160.0, "speed": 153.6},
        "w1_llamacpp_f16": {"pp": 256, "tg": 128, "pl": 64, "t": 80.0, "speed": 307.2},
        "server_main_tokenserve": {"engine": "tokenserve", "session": "main", "ready_s": 2.5,
                                   "rss_kib": 1024 * 900, "peak_rss_kib": 1024 * 1000,
                                   "pss_kib": 1024 * 800},
        "server_w4_mbt_256_tokenserve": {"engine": "tokenserve", "session": "w4_mbt_256",
                                         "ready_s": 9.0, "rss_kib": 1, "peak_rss_kib": 1,
                                         "pss_kib": 1},
        "server_main_vllm_bf16": {"engine": "vllm_bf16", "session": "main", "ready_s": 100.0,
                                  "rss_kib": 1024 * 3000, "peak_rss_kib": 1024 * 3600,
                                  "pss_kib": 1024 * 2400},
        # A sitting from before PSS was recorded: its server has no PSS figure.
        "server_main_llamacpp_f16": {"engine": "llamacpp_f16", "session": "main", "ready_s": 1.0,
                                     "rss_kib": 1024 * 450, "peak_rss_kib": 1024 * 500},
        "startup_tokenserve": {"summary": {"ready_s": {"median": 2.0},
                                           "first_answer_s": {"median": 2.75}}},
    }
    write_results(tmp_path, files)

    assert load_report_script().main(str(tmp_path)) == 0

    printed = capsys.readouterr().out
    assert "CPU: Intel(R) Xeon(R) Processor, 2 CPU(s); avx2, avx512f, avx512_bf16, amx_tile" in printed
    assert (
        "| figure | tokenserve | vLLM | vLLM bf16 | llama.cpp | llama.cpp F16 | tokenserve / vLLM "
        "| tokenserve / vLLM bf16 | tokenserve / llama.cpp | tokenserve / llama.cpp F16 |"
    ) in printed
    assert "| total tok/s | 300.0 | 600.0 | 1200.0 | 153.6 | 307.2 | 0.50 | 0.25 | 1.95 | 0.98 |" in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    servers = summary["servers"]
    # The main session's server, not another session's.
    assert servers["tokenserve"]["server ready s"] == 2.5
    assert servers["tokenserve"]["RSS MiB"] == 900 and servers["tokenserve"]["peak RSS MiB"] == 1000
    assert servers["tokenserve"]["start: first answer s"] == 2.75
    assert servers["vllm_bf16"]["RSS MiB"] == 3000
    assert "| RSS MiB | 900.0 | - | 3000.0 | 450.0 | - | 0.30 | 2.00 |" in printed
    # PSS where the sitting recorded it (shared pages counted once across a server's processes).
    assert servers["tokenserve"]["PSS MiB"] == 800 and servers["vllm_bf16"]["PSS MiB"] == 2400
    assert "PSS MiB" not in servers["llamacpp_f16"]
    assert "| PSS MiB | 800.0 | - | 2400.0 | - | - | 0.33 | - |" in printed


def test_report_puts_tokenserve_in_float32_beside_the_float32_peers(tmp_path, capsys):
    files = {
        "w1_tokenserve": {"output_tokens_per_second": 100.0, "total_tokens_per_second": 300.0,
                          "elapsed_time": 80.0},
        "w1_tokenserve_fp32": {"output_tokens_per_second": 50.0,
                               "total_tokens_per_second": 150.0, "elapsed_time": 160.0},
        "w1_vllm": {"num_requests": 64, "elapsed_time": 40.96, "tokens_per_second": 600.0},
        "w1_llamacpp": {"pp": 256, "tg": 128, "pl": 64, "t": 160.0, "speed": 75.0},
        "server_main_tokenserve": {"engine": "tokenserve", "session": "main", "ready_s": 2.5,
                                   "rss_kib": 1024 * 900, "peak_rss_kib": 1024 * 1000},
        "server_main_tokenserve_fp32": {"engine": "tokenserve_fp32", "session": "main",
                                        "ready_s": 3.0, "rss_kib": 1024 * 1200,
                                        "peak_rss_kib": 1024 * 1300},
    }
    write_results(tmp_path, files)

    assert load_report_script().main(str(tmp_path)) == 0

    printed = capsys.readouterr().out
    assert (
        "| figure | tokenserve | tokenserve fp32 | vLLM | llama.cpp | tokenserve / vLLM "
        "| tokenserve / llama.cpp | tokenserve fp32 / vLLM | tokenserve fp32 / llama.cpp |"
    ) in printed
    assert "| total tok/s | 300.0 | 150.0 | 600.0 | 75.0 | 0.50 | 4.00 | 0.25 | 2.00 |" in printed
    servers = json.loads((tmp_path / "summary.json").read_text())["servers"]
    # Each tokenserve configuration keeps its own server, the fp32 one not taken for the other.
    assert servers["tokenserve"]["RSS MiB"] == 900
    assert servers["tokenserve_fp32"]["RSS MiB"] == 1200


def test_report_gives_the_price_of_fresh_memory_at_the_start_and_end(tmp_path, capsys):
    # benchmarks/first_touch.py's JSON: 256 MiB chunks, the dear price from the third on.
    for when, chunks in (("start", [1.3, 1.28, 45.5, 48.0]), ("end", [1.25, 1.31])):
        (tmp_path / f"first_touch_{when}.json").write_text(json.dumps(
            {"page_bytes": 4096, "chunk_mib": 256.0, "first_touch_us_per_page": chunks,
             "first_touch_median_us_per_page": 0.0, "resident_us_per_page": 0.03}))

    assert load_report_script().main(str(tmp_path)) == 0

    assert ("Fresh memory, first write (benchmarks/first_touch.py): start 1.28-48.00 us a "
            "page over 1 GiB; end 1.25-1.31 us a page over 0.5 GiB") in capsys.readouterr().out


def test_report_has_no_fresh_memory_line_where_it_was_not_measured(tmp_path, capsys):
    assert load_report_script().main(str(tmp_path)) == 0
    assert "Fresh memory" not in capsys.readouterr().out


def test_report_has_a_table_for_each_long_prefill_threshold_of_the_run(tmp_path, capsys):
    files = {
        "w2_rate_2_tokenserve": serve_result(50.0, ["a"]),
        "w2_lpt_128_rate_2_tokenserve": serve_result(51.0, ["a"]),
        "w2_lpt_128_rate_2_vllm_bf16": serve_result(30.0, ["a"]),
        "w2_lpt_64_rate_2_tokenserve": serve_result(52.0, ["a"]),
        "w3_prefix_cache_on_tokenserve": serve_result(60.0, ["a"]),
    }
    write_results(tmp_path, files)

    assert load_report_script().main(str(tmp_path)) == 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    # After W2 at 2 req/s, smallest threshold first, then the rest of the workloads.
    assert list(summary) == ["w2_rate_2", "w2_lpt_64_rate_2", "w2_lpt_128_rate_2",
                             "w3_prefix_cache_on"]
    assert summary["w2_lpt_128_rate_2"]["vllm_bf16"]["output tok/s"] == 30.0
    assert "### w2_lpt_64_rate_2" in capsys.readouterr().out


def ceilings_result(ceiling: dict[str, float], reads: dict[str, float]) -> dict:
    """benchmarks/matmul_ceiling.py's --json: 1 GFLOP a token through the layers, 0.5 a
    logits row."""
    return {"ceiling_gflops": ceiling, "read_gb_per_s": reads,
            "layer_flops_per_token": 1_000_000_000, "logits_flops_per_row": 500_000_000}


def test_report_states_w1_against_the_machines_matmul_ceiling(tmp_path, capsys):
    files = {
        "w1_tokenserve": W1_TOKENSERVE,
        "w1_vllm": W1_VLLM,
        "ceilings_start": ceilings_result({"float32": 250.0, "bfloat16": 1250.0},
                                          {"96": 31.3, "512": 21.5}),
        "ceilings_end": ceilings_result({"float32": 240.0, "bfloat16": 1300.0}, {"512": 20.0}),
    }
    write_results(tmp_path, files)

    assert load_report_script().main(str(tmp_path)) == 0

    w1 = json.loads((tmp_path / "summary.json").read_text())["w1"]
    # 300 tokens a second through the layers, 100 logits rows: 300 + 50 GFLOP/s, against the
    # highest ceiling of either measurement (bfloat16 at the end).
    assert w1["tokenserve"]["model GFLOP/s"] == 350.0
    assert w1["tokenserve"]["of the matmul ceiling"] == 350.0 / 1300.0
    assert w1["vllm"]["model GFLOP/s"] == 600.0 + 0.5 * 64 * 128 / 40.96
    printed = capsys.readouterr().out
    assert ("Matmul ceiling on M0's shapes and read rates (benchmarks/matmul_ceiling.py): "
            "start float32 250, bfloat16 1250 GFLOP/s; read GB/s 31.3 over 96 MiB, 21.5 over "
            "512 MiB; end float32 240, bfloat16 1300 GFLOP/s; read GB/s 20.0 over 512 MiB"
            ) in printed
    assert "| model GFLOP/s | 350.0 |" in printed


def test_report_has_no_ceiling_line_or_rows_where_it_was_not_measured(tmp_path, capsys):
    write_results(tmp_path, {"w1_tokenserve": W1_TOKENSERVE})
    assert load_report_script().main(str(tmp_path)) == 0
    assert "Matmul ceiling" not in capsys.readouterr().out
    assert "model GFLOP/s" not in json.loads((tmp_path / "summary.json").read_text())["w1"][
        "tokenserve"]
