"""A GGUF model's products of few rows with x rounded to 8 bits per block (--int8-activation-
max-rows; kernels/csrc/quant_i8.h): which products take it, that a fused step gives what
operator by operator gives, and how far its logprobs lie from the float32 model's.

Tolerance. A bfloat16 model's products round x and the weights to 8 significant bits; this
path rounds x to 8 bits per 32-value block (a step of max |x| / 127) and keeps the weights
exact. The two roundings are of the same order, so the test measures the bf16 path's own
error on the same tokens (its prefill, against the float32 model's) as the budget and holds
the 8-bit path's decode logprobs to twice that, and its greedy tokens to the float32 model's
wherever that model's best token leads its second by more than twice the budget."""

from __future__ import annotations

import pytest

from tokenserve import LLM, SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.config import DEFAULT_INT8_ACTIVATION_MAX_ROWS
from tokenserve.kernels import cpu_isa
from tokenserve.model.layers.quantization.gguf import QuantizedWeight

pytestmark = pytest.mark.skipif(
    not set(cpu_isa.ISA_LEVELS["avx2"][0]) <= cpu_isa.cpu_flags(),
    reason="the 8-bit block kernel is built on the x86-64 levels (AVX2 and up)",
)

VOCAB = 49152


def _model(llm: LLM):
    (model,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner.model)
    return model


def _i8_rows(llm: LLM) -> set[int]:
    return {module.blocks.i8_max_rows for module in _model(llm).modules()
            if getattr(module, "blocks", None) is not None}


@pytest.mark.parametrize("engine_args,rows", [
    ({"dtype": "bfloat16"}, DEFAULT_INT8_ACTIVATION_MAX_ROWS),
    ({"dtype": "float32"}, 0),  # float32 asked for: float32 products
    ({"dtype": "float32", "int8_activation_max_rows": 2}, 2),
    ({"dtype": "bfloat16", "int8_activation_max_rows": 0}, 0),
    ({"dtype": "bfloat16", "bf16_quantized_max_rows": 2}, 2),  # never past the blocks' limit
    pytest.param({"dtype": "bfloat16", "batch_invariant": True, "max_num_batched_tokens": 256},
                 0, marks=pytest.mark.skipif(
                     not set(cpu_isa.ISA_LEVELS["amx"][0]) <= cpu_isa.cpu_flags(),
                     reason="batch_invariant needs the amx level")),
    # The AVX2 form (vpmaddubsw) forced where the host has better.
    ({"dtype": "bfloat16", "cpu_isa": "avx2"}, DEFAULT_INT8_ACTIVATION_MAX_ROWS),
])
def test_which_products_round_x_to_8_bits(engine_args, rows):
    llm = LLM(kv_cache_memory="32MiB", **engine_args)
    assert _i8_rows(llm) == {rows}
    # The kernel's copy of each weight is made at load where it is used, and only there.
    copies = {module.blocks._kernels._i8_weight is not None for module in _model(llm).modules()
              if getattr(module, "blocks", None) is not None}
    assert copies == {rows > 0}


def test_int8_activation_max_rows_must_not_be_negative():
    with pytest.raises(ValueError, match="int8_activation_max_rows must be a non-negative"):
        LLM(kv_cache_memory="32MiB", int8_activation_max_rows=-1)


def _generate(llm: LLM, prompts, params, fused: bool):
    """Each output's tokens and top logprobs, with the layers' steps fused or not."""
    _model(llm).model.layer_stack.enabled = fused
    return [(list(o.outputs[0].token_ids),
             [sorted((k, v.logprob) for k, v in step.items()) for step in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_fused_steps_give_what_operator_by_operator_gives(monkeypatch, fused_calls):
    seen: list[tuple[int, bool]] = []
    original = QuantizedWeight.matmul

    def recording(self, x, *args, **kwargs):
        seen.append((x.shape[0], x.shape[0] <= self.i8_max_rows))
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(QuantizedWeight, "matmul", recording)
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in random_token_prompts(6, 20, VOCAB, seed=2)]
    # Decode steps of 6 rows down to 1 (the requests end one after another).
    params = [SamplingParams(temperature=0.0, max_tokens=2 + 2 * i, ignore_eos=True, logprobs=3)
              for i in range(6)]

    expected = _generate(llm, prompts, params, fused=False)
    assert {rows for rows, i8 in seen if i8} == {1, 2, 3, 4}  # layers and logits
    assert {rows for rows, i8 in seen if not i8} >= {5, 6}
    assert _generate(llm, prompts, params, fused=True) == expected
    assert set(fused_calls) >= {1, 2, 3, 4, 5, 6}


def test_fused_prompt_steps_round_x_together_and_give_what_operators_give(fused_calls):
    # Prompt steps of more than 16 rows on the 8-bit kernel: in the fused layer the threads
    # round x into one buffer between them (decode_layer.c, I8_SHARED_ROUND_ROWS), and a
    # product of more than 64 rows goes over the panels 64 rows at a time.
    llm = LLM(dtype="float32", int8_activation_max_rows=512, kv_cache_memory="64MiB",
              enable_prefix_caching=False)
    assert _i8_rows(llm) == {512}
    prompts = [{"prompt_token_ids": p} for p in random_token_prompts(5, 30, VOCAB, seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)

    expected = _generate(llm, prompts, params, fused=False)
    assert _generate(llm, prompts, params, fused=True) == expected
    assert 150 in fused_calls and 5 in fused_calls  # the prompt step and a decode step


def _prompt_logprobs(llm: LLM, sequences: list[list[int]]) -> list[list[dict]]:
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                           SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)
    return [o.prompt_logprobs for o in outputs]


@pytest.mark.parametrize("engine_args", [
    {"dtype": "bfloat16"},  # by default
    {"dtype": "float32", "int8_activation_max_rows": DEFAULT_INT8_ACTIVATION_MAX_ROWS},
])
def test_decode_logprobs_stay_within_the_bf16_paths_error_of_float32(engine_args):
    prompts = random_token_prompts(6, 24, VOCAB, seed=3)
    llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, **engine_args)
    assert _i8_rows(llm) == {DEFAULT_INT8_ACTIVATION_MAX_ROWS}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    # One request at a time: decode steps of one row, all on the 8-bit kernel.
    generated = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
                 for p in prompts]
    del llm
    sequences = [p + list(g.token_ids) for p, g in zip(prompts, generated)]
    reference = _prompt_logprobs(LLM(dtype="float32", kv_cache_memory="64MiB",
                                     enable_prefix_caching=False), sequences)
    bf16 = _prompt_logprobs(LLM(dtype="bfloat16", int8_activation_max_rows=0,
                                kv_cache_memory="64MiB", enable_prefix_caching=False), sequences)
    budget = max(abs(b[t][s[t]].logprob - r[t][s[t]].logprob)
                 for s, b, r in zip(sequences, bf16, reference) for t in range(1, len(s)))
    assert 0 < budget < 1
    worst = 0.0
    for prompt, out, s, r in zip(prompts, generated, sequences, reference):
        for k, token in enumerate(out.token_ids):
            at = r[len(prompt) + k]
            worst = max(worst, abs(out.logprobs[k][token].logprob - at[token].logprob))
            best, second = sorted(at.values(), key=lambda v: -v.logprob)[:2]
            if best.logprob - second.logprob > 2 * budget:
                assert token == max(at, key=lambda t: at[t].logprob)
    assert worst <= 2 * budget, (worst, budget)
    assert worst > 0  # x was rounded
