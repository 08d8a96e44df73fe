"""Decode steps of few rows as one C call per layer (model/fused_decode.py) against the
operator-by-operator path: the same operators in the same order, so identical results."""

from __future__ import annotations

import pytest
import torch

from tokenserve import LLM, SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.model.fused_decode import FusedDecode
from tokenserve.model.linear import DISABLE_ENV as DISABLE_ONEDNN_ENV


def _generate(llm: LLM, fused: bool, num_prompts: int):
    """Greedy tokens and top-2 logprobs for prompts of different lengths; the fused path on
    or off."""
    model = llm.llm_engine.engine_core.model_runner.model
    if model._fused_decode is None:
        model._fused_decode = FusedDecode(model)
    model._fused_decode.usable = fused
    prompts = [
        prompt[: 20 + 9 * index]
        for index, prompt in enumerate(random_token_prompts(num_prompts, 128, 49152, seed=3))
    ]
    # Different lengths, so that requests finish one by one and steps shrink row by row.
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        [
            SamplingParams(temperature=0.0, max_tokens=8 + 2 * index, ignore_eos=True, logprobs=2)
            for index in range(num_prompts)
        ],
        use_tqdm=False,
    )
    return [
        (
            list(output.outputs[0].token_ids),
            [sorted((k, v.logprob) for k, v in step.items())
             for step in output.outputs[0].logprobs],
        )
        for output in outputs
    ]


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = FusedDecode.forward

    def counting(self, hidden_states, *args):
        calls.append(hidden_states.shape[0])
        return original(self, hidden_states, *args)

    monkeypatch.setattr(FusedDecode, "forward", counting)
    return calls


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_fused_layers_equal_operators_one_by_one(kv_cache_dtype, fused_calls):
    llm = LLM(kv_cache_memory="128MiB", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    assert FusedDecode(llm.llm_engine.engine_core.model_runner.model).usable
    expected = _generate(llm, fused=False, num_prompts=5)
    assert fused_calls == []
    assert _generate(llm, fused=True, num_prompts=5) == expected
    assert fused_calls and set(fused_calls) <= {1, 2, 3, 4, 5}


def test_fused_layers_add_a_qkv_bias_pick_each_kernel_and_leave_large_steps_alone(
    fused_calls, monkeypatch
):
    # Unpacked float32 weights for the prompts' products: oneDNN's packed forms were made
    # without the bias added below.
    monkeypatch.setenv(DISABLE_ONEDNN_ENV, "1")
    llm = LLM(kv_cache_memory="128MiB", enable_prefix_caching=False)
    model = llm.llm_engine.engine_core.model_runner.model
    generator = torch.Generator().manual_seed(0)
    for layer in model.layers:
        layer.qkv_bias = 0.1 * torch.randn(layer.qkv_weight.shape[0], generator=generator)
        # Row limits low enough for 12 requests to step through all three regimes: 1-4 rows
        # on the few-row kernel, 5-8 on the many-row one, 9-12 not fused.
        for weight in layer.quantized.values():
            weight.max_rows, weight.gemm_max_rows = 4, 8
    model._fused_decode = FusedDecode(model)
    assert model._fused_decode.max_rows == 8
    expected = _generate(llm, fused=False, num_prompts=12)
    assert _generate(llm, fused=True, num_prompts=12) == expected
    assert set(fused_calls) & {1, 2, 3, 4} and set(fused_calls) & {5, 6, 7, 8}
    assert max(fused_calls) <= 8
