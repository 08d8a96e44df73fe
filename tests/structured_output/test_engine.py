"""The engine core's side of structured outputs, on a tiny model: a request waits for its
grammar without holding back others, grammars are compiled once per spec, the grammar
state survives preemption, a finished grammar ends the request, a failed compile ends
only its request, the enforce-after hook leaves the tokens before its marker free, and
the engine-core process (which loads its own tokenizer) enforces grammars too."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from tokenserve import LLM, SamplingParams, StructuredOutputsParams
from tokenserve.core.request import Request, RequestStatus
from tokenserve.engine.async_llm import AsyncLLM
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.sampling_params import RequestOutputKind
from tokenserve.structured_output.manager import StructuredOutputManager

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 120, 250, 8, 9, 10], [44, 45]]
DIGITS = r"[0-9]{2,4}"


@pytest.fixture(scope="module")
def llm(tiny_model_dirs) -> LLM:
    return LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB")


def generate(llm: LLM, prompts, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def regex_params(pattern: str = DIGITS, **kwargs) -> SamplingParams:
    settings = {"temperature": 0.0, "max_tokens": 32} | kwargs
    return SamplingParams(structured_outputs=StructuredOutputsParams(regex=pattern), **settings)


def count_compiles(
    monkeypatch, manager: StructuredOutputManager, gate: threading.Event | None = None
):
    calls = []
    compile_now = manager._compile

    def counted(spec):
        calls.append(spec)
        if gate is not None:
            assert gate.wait(timeout=60)
        return compile_now(spec)

    monkeypatch.setattr(manager, "_compile", counted)
    return calls


def test_request_waits_for_its_grammar_and_others_run(tiny_model_dirs, monkeypatch):
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB")
    engine = llm.llm_engine
    gate = threading.Event()
    count_compiles(monkeypatch, engine.engine_core.structured_output_manager, gate)
    engine.add_request("constrained", {"prompt_token_ids": PROMPTS[0]}, regex_params())
    engine.add_request(
        "free", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=4, ignore_eos=True)
    )
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    waiting = engine.engine_core.scheduler.requests["constrained"]
    assert waiting.status == RequestStatus.WAITING_FOR_GRAMMAR
    assert waiting.num_output_tokens == 0
    gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    constrained = finished["constrained"].outputs[0]
    assert constrained.finish_reason == "stop"
    assert re.fullmatch(DIGITS, constrained.text)
    assert engine.get_stats().kv_cache_usage == 0.0


def test_same_spec_compiles_once(llm, monkeypatch):
    calls = count_compiles(monkeypatch, llm.llm_engine.engine_core.structured_output_manager)
    pattern = "[a-z]{3}"  # a spec no other test of this module uses
    first = generate(llm, PROMPTS, regex_params(pattern))
    second = generate(llm, PROMPTS[:1], regex_params(pattern, n=3, temperature=1.0, seed=1))
    assert len(calls) == 1
    assert all(re.fullmatch(pattern, o.text) for o in first + second)


def test_grammar_state_survives_preemption(tiny_model_dirs, llm):
    prompts = [list(range(3 + i, 60 + i)) for i in range(6)]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9a-f]{30}"),
    )
    expected = generate(llm, prompts, params)
    # 12 blocks of 16 tokens cannot hold six 57-token prompts growing to 87: preemption
    # (admission lookahead off, or requests would wait instead).
    small = LLM(
        tiny_model_dirs["llama"],
        num_kv_blocks=12,
        block_size=16,
        max_model_len=128,
        admission_lookahead_tokens=0,
    )
    outputs = generate(small, prompts, params)
    assert small.llm_engine.get_stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert all(re.fullmatch(r"[0-9a-f]{30}", o.text) for o in outputs)
    assert small.llm_engine.get_stats().kv_cache_usage == 0.0


def test_finished_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=50,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["first", "second"]),
    )
    [output] = generate(llm, PROMPTS[:1], params)
    assert output.text in ("first", "second")
    assert output.finish_reason == "stop"


def test_failed_compile_ends_only_its_request(llm):
    core = llm.llm_engine.engine_core
    # Straight into the core, past the Processor that would have refused it.
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(a"))
    core.add_request(Request("bad", PROMPTS[0], bad, eos_token_id=0))
    core.add_request(Request("good", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True), 0))
    outputs = {}
    while core.has_unfinished_requests():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert [o.finish_reason for o in outputs["bad"]] == ["abort"]
    assert sum(len(o.new_token_ids) for o in outputs["good"]) == 4
    assert core.make_stats().kv_cache_usage == 0.0


def test_grammar_applies_only_after_the_enforce_after_marker(llm):
    [free] = generate(
        llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    marker = free.token_ids[:2]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=32,
        structured_outputs=StructuredOutputsParams(
            regex="[0-9]{3}", enforce_after_token_ids=marker
        ),
    )
    [output] = generate(llm, PROMPTS[:1], params)
    assert output.token_ids[:2] == marker  # free until the marker is out
    tokenizer = llm.get_tokenizer()
    assert re.fullmatch(
        "[0-9]{3}", tokenizer.decode(output.token_ids[2:], skip_special_tokens=True)
    )
    assert output.finish_reason == "stop"


def test_engine_core_process_compiles_with_its_own_tokenizer(tiny_model_dirs, llm):
    """Through AsyncLLM: validation in this process, compile and masks in the engine's."""
    [expected] = generate(llm, PROMPTS[:1], regex_params())

    async def run() -> list[int]:
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=tiny_model_dirs["llama"], kv_cache_memory="64MiB")
        )
        try:
            with pytest.raises(ValueError, match="Invalid regex"):
                async for _ in engine.generate(
                    {"prompt_token_ids": PROMPTS[0]}, regex_params("[0-9"), "bad"
                ):
                    pass
            params = regex_params(output_kind=RequestOutputKind.FINAL_ONLY)
            token_ids: list[int] = []
            async for output in engine.generate({"prompt_token_ids": PROMPTS[0]}, params, "r"):
                token_ids = output.outputs[0].token_ids
            return token_ids
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == expected.token_ids
