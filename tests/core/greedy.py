"""A short greedy run of an engine core, for tests that compare two engines' tokens."""

from __future__ import annotations

from tokenserve import SamplingParams
from tokenserve.core.engine_core import EngineCore
from tokenserve.core.request import Request


def greedy_tokens(core: EngineCore) -> list[int]:
    """The tokens of one greedy request ([5, 6, 7, 8], 6 new tokens) run to its end."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    core.add_request(Request("r", [5, 6, 7, 8], params, eos_token_id=None))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for output in core.step() for t in output.new_token_ids]
    return tokens
