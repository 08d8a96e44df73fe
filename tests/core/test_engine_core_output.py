"""EngineCoreOutput crosses the process boundary with msgspec, logprobs included."""

from __future__ import annotations

import msgspec

from tokenserve.core.scheduler import EngineCoreOutput
from tokenserve.sample.logprobs import LogprobsLists


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
