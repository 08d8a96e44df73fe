"""AsyncLLM: the engine core in its own process gives what the in-process engine gives;
slow consumers get merged deltas; closing a generator aborts its request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from tokenserve import LLM
from tokenserve.engine.async_llm import AsyncLLM, RequestOutputCollector
from tokenserve.engine.core_client import EngineDeadError
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.outputs import CompletionOutput, RequestOutput
from tokenserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenserve.messages.engine_core import SchedulerStats
    from tokenserve.metrics.stats import IterationStats

PROMPTS = ["Hello, world!", "The capital of France is", "Once upon a time there was"]
# Only a stuck engine takes this long: the wait ends as soon as the stats say so.
STATS_TIMEOUT_S = 60.0
LONG_GENERATION = 2000  # as long as max_model_len (2048) allows


def sampling_params(kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(
        n=2, temperature=1.0, seed=11, max_tokens=12, logprobs=2, ignore_eos=True, output_kind=kind
    )


def delta(index: int, text: str, token_ids: list[int], finish_reason=None) -> RequestOutput:
    completion = CompletionOutput(index, text, token_ids, finish_reason=finish_reason)
    return RequestOutput("r", "p", [1], [completion], finished=finish_reason is not None)


def test_collector_merges_deltas_for_a_slow_consumer():
    async def run() -> RequestOutput:
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        collector.put(delta(0, "a", [1]))
        collector.put(delta(1, "x", [7]))
        collector.put(delta(0, "b", [2], finish_reason="length"))
        return await collector.get()

    merged = asyncio.run(run())
    by_index = {completion.index: completion for completion in merged.outputs}
    assert (by_index[0].text, by_index[0].token_ids, by_index[0].finish_reason) == (
        "ab",
        [1, 2],
        "length",
    )
    assert (by_index[1].text, by_index[1].token_ids) == ("x", [7])
    assert merged.finished


def test_collector_keeps_an_error_over_later_outputs():
    async def run() -> None:
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        collector.put(EngineDeadError("gone"))
        collector.put(delta(0, "a", [1]))
        await collector.get()

    with pytest.raises(EngineDeadError):
        asyncio.run(run())


class SchedulerStatsWatch:
    """A stat logger that lets a test await the engine core's stats meeting a condition, and
    counts the tokens the engine core has scheduled."""

    def __init__(self) -> None:
        self.latest: SchedulerStats | None = None
        self.num_scheduled_tokens = 0
        self.changed = asyncio.Event()

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats
    ) -> None:
        self.num_scheduled_tokens += iteration_stats.num_scheduled_tokens
        if scheduler_stats is not None:
            self.latest = scheduler_stats
            self.changed.set()

    def log(self) -> None:
        pass

    async def wait_until(self, condition: Callable[[SchedulerStats], bool]) -> None:
        async with asyncio.timeout(STATS_TIMEOUT_S):
            while self.latest is None or not condition(self.latest):
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


def test_async_llm_equals_the_in_process_engine(model_dir):
    offline = LLM(model_dir, kv_cache_memory="64MiB")
    expected = offline.generate(
        PROMPTS, sampling_params(RequestOutputKind.FINAL_ONLY), use_tqdm=False
    )

    async def run() -> tuple[list[dict[int, list[int]]], list[list[float]]]:
        stats = SchedulerStatsWatch()
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=model_dir, kv_cache_memory="64MiB"), stat_loggers=[stats]
        )
        try:

            async def one(index: int, prompt: str) -> tuple[dict[int, list[int]], list[float]]:
                tokens: dict[int, list[int]] = {0: [], 1: []}
                logprobs: list[float] = []
                params = sampling_params(RequestOutputKind.DELTA)
                async for output in engine.generate(prompt, params, f"req-{index}"):
                    for completion in output.outputs:
                        tokens[completion.index] += completion.token_ids
                        for token_id, position in zip(completion.token_ids, completion.logprobs):
                            logprobs.append(position[token_id].logprob)
                return tokens, logprobs

            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

            # A request closed early is aborted: its blocks are freed in the engine core. Its
            # first output means it runs and holds blocks; then the engine core's stats are
            # awaited until they show them free, and it must not have run to its end.
            params = SamplingParams(
                max_tokens=LONG_GENERATION, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            outputs = engine.generate("Hello", params, "aborted")
            await outputs.__anext__()
            await outputs.aclose()
            scheduled_before = stats.num_scheduled_tokens
            await stats.wait_until(
                lambda latest: latest.num_running_reqs == 0 and latest.kv_cache_usage == 0.0
            )
            # Stopped well before its end (running to it would compute ~LONG_GENERATION).
            assert stats.num_scheduled_tokens - scheduled_before < LONG_GENERATION // 2
            return [r[0] for r in results], [r[1] for r in results]
        finally:
            engine.shutdown()

    tokens, logprobs = asyncio.run(run())
    for output, got_tokens, got_logprobs in zip(expected, tokens, logprobs):
        want = {c.index: c.token_ids for c in output.outputs}
        assert got_tokens == want
        want_logprobs = [
            position[token_id].logprob
            for c in sorted(output.outputs, key=lambda c: c.index)
            for token_id, position in zip(c.token_ids, c.logprobs)
        ]
        assert sorted(got_logprobs) == pytest.approx(sorted(want_logprobs), abs=1e-5)
