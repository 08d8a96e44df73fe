"""--request-trace: finished requests as Mooncake lines, block ids chained like Mooncake's."""

from __future__ import annotations

import json

from tokenserve.messages.engine_core import EngineCoreOutput, EngineCoreOutputs
from tokenserve.metrics.request_trace import BlockIdNumbering, RequestTraceRecorder


def test_block_ids_are_chained_and_numbered_by_first_appearance():
    numbering = BlockIdNumbering()
    a = list(range(1200))
    b = a[:512] + [7] * 600  # same first block, then different
    c = [7] * 512 + a[512:1024]  # second block equal to a's, first not: a different prefix
    assert numbering.hash_ids(a) == [0, 1, 2]
    assert numbering.hash_ids(b) == [0, 3, 4]
    assert numbering.hash_ids(c) == [5, 6]
    assert numbering.hash_ids(a[:1024] + [9]) == [0, 1, 7]  # the partial tail counts
    assert numbering.hash_ids([]) == []


def test_recorder_writes_finished_requests_only(tmp_path):
    path = tmp_path / "trace.jsonl"
    recorder = RequestTraceRecorder(str(path))
    start = recorder._started
    recorder.add_request("r1", list(range(600)), start + 1.5)
    recorder.add_request("r2", list(range(600)), start + 2.0)
    recorder.add_request("r3", [1, 2, 3], start + 2.5)
    recorder.record(EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [5]), EngineCoreOutput("r2", [5])]))
    recorder.record(EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [6, 7], finish_reason="length")]))
    recorder.drop_requests(["r3"])  # aborted by its client: not traffic to replay
    recorder.record(EngineCoreOutputs(outputs=[EngineCoreOutput("r2", [6], finish_reason="stop")]))
    recorder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 2000, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]},
    ]
