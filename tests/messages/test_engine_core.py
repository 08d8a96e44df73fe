"""What crosses the engine-core boundary survives msgpack as it is, logprobs and stats included."""

from __future__ import annotations

import msgspec

from tokenserve.messages.engine_core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    SchedulerStats,
    make_encoder,
    make_outputs_decoder,
)


def test_engine_core_output_msgspec_round_trip():
    output = EngineCoreOutput(
        "r",
        [7],
        finish_reason="stop",
        stop_reason="###",
        num_cached_tokens=16,
        new_logprobs=LogprobsLists([[7, 3, 7]], [[-0.5, -0.25, -0.5]], [2]),
        new_prompt_logprobs=LogprobsLists([[4], [5]], [[-1.0], [-2.0]], [3, 9]),
    )
    encoded = msgspec.msgpack.encode(output)
    assert msgspec.msgpack.decode(encoded, type=EngineCoreOutput) == output


def test_engine_core_outputs_round_trip_with_scheduler_stats():
    message = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [1, 2]), EngineCoreOutput("b", [], finish_reason="abort")],
        timestamp=12.5,
        scheduler_stats=SchedulerStats(
            2, 1, 0.25, 10, 4, 1, token_budget=512, predicted_step_ms=7.5
        ),
        num_scheduled_tokens=3,
        first_scheduled_times={"a": 12.0},
    )
    assert make_outputs_decoder().decode(make_encoder().encode(message)) == message
