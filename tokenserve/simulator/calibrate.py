"""`tokenserve calibrate`: fit the step-cost model on this machine, for the simulator.

Runs the real engine (its engine-core process, and the streaming and detokenizing
of this process, as a server has them) through rounds of requests chosen to spread step
shapes: prompt chunks of several lengths after several contexts, and decode batches of
several sizes and contexts; twice, fitting only the second pass (first-time shapes cost
setup a server pays once). Each step's wall time and shape go into
a `StepCostModel` (core/step_cost.py, the one `--target-step-ms` learns online), whose
fit is written as cost.json. The quick form (`simulate` without `--cost-model`) runs
fewer rounds and takes well under a minute with the default model.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import logging
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import uvicorn

from tokenserve.benchmarks.datasets import BenchRequest
from tokenserve.benchmarks.openai_client import CompletionTarget, send_streaming
from tokenserve.config import EngineConfig
from tokenserve.core.step_cost import (
    NUM_REGIME_FEATURES,
    KernelRegimeCostModel,
    StepCostModel,
    StepShape,
)
from tokenserve.engine.async_llm import AsyncLLM
from tokenserve.messages.engine_core import EngineCoreOutputs
from tokenserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# The served model name the calibration's own server answers to.
CALIBRATION_MODEL_NAME = "calibration"


@dataclass
class CalibrationRound:
    """Requests submitted together: `count` prompts of `prompt_len`, `output_len` tokens each."""

    count: int
    prompt_len: int
    output_len: int


def calibration_rounds(max_model_len: int, max_num_seqs: int, quick: bool) -> list[CalibrationRound]:
    """Single prompts of several lengths (chunked by the token budget), then decode
    batches of rising size (their prompts mixed with decode rows), then a mixed round."""
    longest = max(16, min(1024 if quick else 2048, max_model_len - 32))
    lengths = (32, 256, 1024) if quick else (64, 256, 1024, 2048)
    rounds = [CalibrationRound(1, min(longest, length), 2) for length in lengths]
    for batch in (1, 8, 32) if quick else (1, 4, 16, 64):
        rounds.append(CalibrationRound(min(batch, max_num_seqs), min(longest, 128), 8 if quick else 16))
    if not quick:
        rounds.append(CalibrationRound(min(8, max_num_seqs), min(longest, 512), 16))
    return rounds


def calibrate(
    config: EngineConfig,
    quick: bool = False,
    serving_app: Callable[[AsyncLLM], Any] | None = None,
) -> tuple[StepCostModel, dict[str, Any]]:
    """Fit a `StepCostModel` on this machine; also return the fit's quality figures.

    The engine runs as it serves: the engine core in its own process, this process
    detokenizing every streamed token as the API process does (on a small machine they
    share the cores, and a step's time shows it). With `serving_app` (the OpenAI app for an
    engine, which the command line passes in), requests go over HTTP to that app served in
    this process, streamed as server-sent events and read back as a client reads them."""
    return asyncio.run(_calibrate(config, quick, serving_app))


class _StepLog:
    """A `RequestObserver` keeping each engine-core message's time and step shape, and
    when requests were sent."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, int, int, int]] = []
        self.arrivals: list[float] = []
        # Per request id: when it reached the engine, and its first token's step ended.
        self.arrived: dict[str, float] = {}
        self.first_token: dict[str, float] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], arrival_time: float) -> None:
        self.arrivals.append(time.time())
        self.arrived[request_id] = self.arrivals[-1]

    def record(self, message: EngineCoreOutputs) -> None:
        self.messages.append((message.timestamp, message.num_scheduled_tokens,
                              message.num_attention_pairs, message.num_decode_tokens))
        for output in message.outputs:
            if output.new_token_ids and output.request_id not in self.first_token:
                self.first_token[output.request_id] = message.timestamp

    def drop_requests(self, request_ids: list[str]) -> None:
        pass

    def close(self) -> None:
        pass

    def samples(self) -> list[tuple[StepShape, float]]:
        """(shape, seconds) of each step: from the previous message, or after an idle
        spell from the last request sent before it (the step could not start earlier)."""
        samples = []
        arrivals = sorted(self.arrivals)
        for previous, (timestamp, tokens, pairs, decode) in itertools.pairwise(self.messages):
            if tokens == 0:
                continue
            started = previous[0]
            if previous[1] == 0:  # the engine was idle: it began with the requests sent
                sent = bisect.bisect_right(arrivals, timestamp)
                if sent == 0:
                    continue
                started = max(started, arrivals[sent - 1])
            if timestamp > started:
                samples.append((StepShape(tokens, pairs, decode), timestamp - started))
        return samples


async def _calibrate(
    config: EngineConfig, quick: bool, serving_app: Callable[[AsyncLLM], Any] | None
) -> tuple[StepCostModel, dict[str, Any]]:
    step_log = _StepLog()
    engine = AsyncLLM(config, log_stats=False, request_observers=[step_log])
    http = await _HttpPath.start(serving_app(engine)) if serving_app is not None else None
    vocab_size = int(getattr(config.model_config.hf_config, "vocab_size", 32000))
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    rounds = calibration_rounds(config.model_config.max_model_len,
                                config.scheduler_config.max_num_seqs, quick)

    async def run_one(request_id: str, prompt: list[int], params: SamplingParams) -> tuple[float, float]:
        """Send one request; when it was sent and its first token came back (time.time())."""
        sent = time.time()
        if http is not None:
            return sent, sent + await http.complete(prompt, params.max_tokens or 1)
        first = 0.0
        async for _ in engine.generate(prompt, params, request_id):
            first = first or time.time()
        return sent, first

    # A lone request's way to the engine and its first token's way back (the second pass).
    delays: list[tuple[float, float]] = []

    try:
        # Twice: the first pass meets each shape for the first time (oneDNN primitives,
        # kernel setup), which a server does once; only the second pass is fitted.
        for number, round_ in enumerate([*rounds, *rounds]):
            if number == len(rounds):
                step_log.messages.clear()
                step_log.arrivals.clear()
            params = SamplingParams(temperature=0.0, max_tokens=round_.output_len, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            known = set(step_log.arrived)
            # Unique prompts: a prefix-cache hit would hide the prompt's cost.
            times = await asyncio.gather(*(
                run_one(f"calibrate-{number}-{index}",
                        rng.integers(100, vocab_size - 100, size=round_.prompt_len).tolist(), params)
                for index in range(round_.count)
            ))
            new_ids = [i for i in step_log.arrived if i not in known]
            if number >= len(rounds) and round_.count == 1 and len(new_ids) == 1:
                (sent, first), request_id = times[0], new_ids[0]
                if request_id in step_log.first_token and first > 0:
                    delays.append((step_log.arrived[request_id] - sent,
                                   first - step_log.first_token[request_id]))
    finally:
        if http is not None:
            await http.stop()
        engine.shutdown()
    samples = step_log.samples()
    if len(samples) < 2 * NUM_REGIME_FEATURES:
        raise ValueError("Calibration recorded too few steps to fit the step-cost model.")
    # Per kernel regime (core/step_cost.py): the row limits the model's products run under.
    bf16 = config.model_config.dtype == "bfloat16"
    few_rows, panel_rows = config.kernel_config.block_row_limits(bf16)
    model = KernelRegimeCostModel.fit(samples, few_rows=few_rows, panel_rows=panel_rows)
    if delays:
        # Medians over the lone requests; never negative (clocks of two processes).
        model.arrival_delay_ms = max(float(np.median([d[0] for d in delays])) * 1e3, 0.0)
        model.output_delay_ms = max(float(np.median([d[1] for d in delays])) * 1e3, 0.0)
    report = _fit_quality(model, samples)
    report["request_delays_ms"] = [[round(a * 1e3, 3), round(b * 1e3, 3)] for a, b in delays]
    report["samples"] = [[s.num_tokens - s.num_decode_tokens, s.attention_pairs,
                          s.num_decode_tokens, round(seconds * 1e3, 3)] for s, seconds in samples]
    report["seconds"] = time.perf_counter() - started
    return model, report


class _HttpPath:
    """The OpenAI app on a local port (uvicorn, as `tokenserve serve` runs it) and a
    streaming client for it (bench serve's)."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], port: int) -> None:
        self.server, self.task = server, task
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=30.0),
                                        limits=httpx.Limits(max_connections=256))
        self.target = CompletionTarget(f"http://127.0.0.1:{port}", "/v1/completions",
                                       CALIBRATION_MODEL_NAME, ignore_eos=True)

    @classmethod
    async def start(cls, app: Any) -> _HttpPath:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="h11",
                                               log_level="warning", lifespan="on"))
        task = asyncio.get_running_loop().create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()  # raises why it stopped
                raise ValueError("The calibration server stopped before it started.")
            await asyncio.sleep(0.05)
        return cls(server, task, port)

    async def complete(self, prompt: list[int], max_tokens: int) -> float:
        """Send one request and read its stream; seconds to its first token."""
        result = await send_streaming(self.client, self.target, BenchRequest(prompt, max_tokens),
                                      prompt, len(prompt))
        if not result.success or result.ttft is None:
            raise ValueError(f"A calibration request failed: {result.error}")
        return result.ttft

    async def stop(self) -> None:
        await self.client.aclose()
        self.server.should_exit = True
        await self.task


def _fit_quality(model: StepCostModel, samples: list[tuple[StepShape, float]]) -> dict[str, Any]:
    errors = [abs(model.predict_ms(shape) - seconds * 1e3) / (seconds * 1e3)
              for shape, seconds in samples if seconds > 0]
    return {
        "num_steps": len(samples),
        "median_relative_error": float(np.median(errors)) if errors else None,
        "p90_relative_error": float(np.percentile(errors, 90)) if errors else None,
    }


def write_cost_file(path: str, model: StepCostModel, config: EngineConfig,
                    report: dict[str, Any]) -> None:
    data = {
        **model.to_dict(),
        "model": str(config.model_config.model),
        "dtype": config.model_config.dtype,
        "machine": platform.processor() or platform.machine(),
        "calibration": report,
    }
    with open(path, "w") as file:
        json.dump(data, file, indent=2)


def read_cost_file(path: str) -> StepCostModel:
    try:
        with open(path) as file:
            data = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read the cost model {path!r}: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} is not a cost model (a JSON object).")  # noqa: TRY004 - bad input
    return StepCostModel.from_dict(data)
