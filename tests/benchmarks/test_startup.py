"""`tokenserve bench startup`: the log marks it reads, its summary, the server's environment,
and one real start of the tiny model through the command line (no timing asserts: only the
order of the phases)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from tokenserve.benchmarks.startup import (
    PHASES,
    StartupRun,
    format_report,
    log_marks,
    server_environment,
    summarize,
)
from tokenserve.entrypoints import cli

LOG = """\
INFO 2026-12-01 10:00:01,250 [engine core] tokenserve.core.engine_core_proc: Engine core process: modules imported.
INFO 2026-12-01 10:00:01,500 [engine core] tokenserve.core.engine_core_proc: Engine core process: configured.
INFO 2026-12-01 10:00:02,750 [engine core] tokenserve.core.engine_core: Engine core ready in 1.2 s: LlamaForCausalLM
INFO 2026-12-01 10:00:09,000 [engine core] tokenserve.core.engine_core: Engine core ready in 9.9 s: a second line
INFO:     Application startup complete.
"""


def test_log_marks_are_seconds_after_the_start():
    started_at = datetime.datetime(2026, 12, 1, 10, 0, 0).timestamp()
    marks = log_marks(LOG, started_at)
    assert marks == {"import": 1.25, "configured": 1.5, "load": 2.75}  # the first of each
    assert log_marks("no marks here\n", started_at) == {}


def test_summary_takes_medians_and_sums_memory():
    runs = [
        StartupRun(1.0, 1.2, 2.0, 2.1, 2.5, 2.9, "hi", {"api": 100, "engine_core": 300}),
        StartupRun(None, None, None, 3.0, 3.5, 3.9, "hi", {"api": 200, "engine_core": 500}),
        StartupRun(1.4, 1.6, 2.4, 2.5, 2.7, 3.1, "hi", {"api": 300, "engine_core": 400}),
    ]
    summary = summarize(runs)
    assert summary["num_runs"] == 3
    assert summary["import_s"] == {"median": 1.2, "min": 1.0, "max": 1.4}  # runs with the mark
    assert summary["first_answer_s"] == {"median": 3.1, "min": 2.9, "max": 3.9}
    assert summary["rss_api_bytes"] == 200
    assert summary["rss_engine_core_bytes"] == 400
    assert summary["rss_total_bytes"] == 700  # median of 400, 700, 700
    report = format_report(summary, cold=False)
    assert "3 warm run(s)" in report and "3.10" in report


def test_the_server_writes_its_bytecode_and_uses_the_cache_directory_given():
    env = server_environment(
        {"PATH": "/bin", "PYTHONDONTWRITEBYTECODE": "1", "TOKENSERVE_CACHE_DIR": "/old"}, "/new")
    assert env == {"PATH": "/bin", "TOKENSERVE_CACHE_DIR": "/new"}


def test_bench_startup_on_a_real_server(tiny_model_dirs: dict[str, str], tmp_path: Path):
    output = tmp_path / "startup.json"
    serve_args = [tiny_model_dirs["llama"], "--max-model-len", "256", "--num-kv-blocks", "16",
                  "--block-size", "16", "--disable-log-stats"]
    assert cli.main(["bench", "startup", "--num-runs", "1", "--output-json", str(output),
                     "--", *serve_args]) == 0
    report = json.loads(output.read_text())
    assert report["serve_args"] == serve_args and report["cold"] is False
    [run] = report["runs"]
    times = [run[f"{name}_s"] for name in PHASES]
    assert None not in times, run  # every mark was found in the server's log
    assert times == sorted(times), run  # imported ≤ configured ≤ loaded ≤ ready ≤ answered
    assert isinstance(run["answer"], str)
    assert run["rss_bytes"]["api"] > 0 and run["rss_bytes"]["engine_core"] > 0
    assert report["summary"]["first_answer_s"]["median"] == run["first_answer_s"]
