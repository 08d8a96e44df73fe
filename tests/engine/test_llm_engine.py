"""LLMEngine.step streaming: DELTA outputs of emoji / CJK text and stop strings, end to end.

The model's sampler is scripted to emit the token ids of a chosen text (the random tiny
model would emit arbitrary bytes); everything else is the real engine.
"""

from __future__ import annotations

import pytest
import torch

from tokenserve.engine.engine_args import EngineArgs
from tokenserve.engine.llm_engine import LLMEngine
from tokenserve.sample.sampler import SamplerOutput
from tokenserve.sampling_params import RequestOutputKind, SamplingParams

EMOJI_CJK_TEXT = "Hi 😀 你好, 🎉 世界! café ñ 🇫🇷 end"


class ScriptedSampler:
    """Samples as usual, then replaces every row's token with the script's next one."""

    def __init__(self, sampler, script: list[int]) -> None:
        self.sampler = sampler
        self.script = iter(script)

    def __call__(self, logits, metadata) -> SamplerOutput:
        output = self.sampler(logits, metadata)
        return SamplerOutput(torch.full_like(output.token_ids, next(self.script)), None)


@pytest.fixture
def engine(tiny_model_dirs) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=tiny_model_dirs["qwen2"], kv_cache_memory="64MiB")
    )


def stream(engine: LLMEngine, params: SamplingParams) -> list:
    script = engine.tokenizer.encode(EMOJI_CJK_TEXT)
    (runner,) = engine.collective_rpc(lambda worker: worker.model_runner)
    runner.sampler = ScriptedSampler(runner.sampler, script)
    engine.add_request("r", "The capital of France is", params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_emoji_and_cjk_stream_through_the_engine(engine):
    num_tokens = len(engine.tokenizer.encode(EMOJI_CJK_TEXT))
    params = SamplingParams(
        max_tokens=num_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    outputs = stream(engine, params)
    deltas = [output.outputs[0].text for output in outputs]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == EMOJI_CJK_TEXT
    assert [t for o in outputs for t in o.outputs[0].token_ids] == engine.tokenizer.encode(
        EMOJI_CJK_TEXT
    )
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_stop_string_ends_the_stream(engine):
    params = SamplingParams(
        max_tokens=100, ignore_eos=True, stop=["世界"], output_kind=RequestOutputKind.DELTA
    )
    outputs = stream(engine, params)
    assert "".join(o.outputs[0].text for o in outputs) == "Hi 😀 你好, 🎉 "
    final = outputs[-1]
    assert final.finished
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "世界"
    assert engine.get_stats().kv_cache_usage == 0.0
