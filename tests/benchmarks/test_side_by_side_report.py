"""benchmarks/side_by_side_report.py on hand-made result files of both engines."""

from __future__ import annotations

import json

from tests.benchmarks.scripts import load_script


def load_report_script():
    return load_script("side_by_side_report")


def serve_result(output_throughput: float, texts: list[str]) -> dict:
    latency = {"mean": 10.0, "p50": 9.0, "p90": 12.0, "p99": 20.0}
    return {
        "summary": {"completed": len(texts), "failed": 0, "num_preemptions": 3,
                    "output_throughput": output_throughput, "request_throughput": 1.0,
                    "ttft_ms": latency, "tpot_ms": latency, "itl_ms": latency, "e2el_ms": latency},
        "requests": [{"success": True, "text": text} for text in texts],
    }


def test_report_puts_engines_side_by_side(tmp_path, capsys):
    files = {
        "w1_tokenserve": {"output_tokens_per_second": 100.0, "total_tokens_per_second": 300.0,
                          "elapsed_time": 80.0},
        # vLLM's own `bench throughput` JSON
        "w1_vllm": {"num_requests": 64, "elapsed_time": 40.96, "tokens_per_second": 600.0,
                    "requests_per_second": 1.5625},
        "w5_unconstrained_tokenserve": serve_result(50.0, ["a", "b"]),
        "w5_constrained_tokenserve": serve_result(40.0, ["a", "x"]),
        "w5_unconstrained_vllm": serve_result(80.0, ["a", "b"]),
        "w5_constrained_vllm": serve_result(100.0, ["a", "b"]),
    }
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

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
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

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
