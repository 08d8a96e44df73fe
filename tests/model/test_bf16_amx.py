"""A bfloat16 GGUF model on the amx level: its products of at most `bf16_quantized_max_rows`
rows (512 there by default) read the GGUF blocks, from 2 rows through the AMX kernel (bf16
numerics, kernels/csrc/quant_amx.h), decode steps up to that many rows run fused (one C
call per layer) with the same results as operator by operator, and the avx512_bf16 level
takes the vdpbf16ps block kernel (the same numerics) up to 16 rows."""

from __future__ import annotations

import pytest
import torch

from tokenserve import LLM, SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.config import BF16_QUANTIZED_MAX_ROWS_DP, DEFAULT_BF16_QUANTIZED_MAX_ROWS
from tokenserve.kernels import cpu_isa
from tokenserve.model.layers.quantization.gguf import AMX_MIN_ROWS, QuantizedWeight

pytestmark = pytest.mark.skipif(
    not set(cpu_isa.ISA_LEVELS["amx"][0]) <= cpu_isa.cpu_flags(), reason="no AMX on this CPU"
)


def _model(llm: LLM):
    (model,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner.model)
    return model


def _blocks(model) -> list[QuantizedWeight]:
    return [module.blocks for module in model.modules()
            if getattr(module, "blocks", None) is not None]


@pytest.fixture
def amx_rows(block_rows_where) -> list[int]:
    """The rows of every product on the AMX block kernel."""
    return block_rows_where(lambda weight: weight.uses_amx)


def _generate(llm: LLM, prompts: list[list[int]], fused: bool):
    _model(llm).model.layer_stack.enabled = fused
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        [SamplingParams(temperature=0.0, max_tokens=3 + index % 4, ignore_eos=True, logprobs=2)
         for index in range(len(prompts))],
        use_tqdm=False,
    )
    return [(list(out.outputs[0].token_ids),
             [sorted((k, v.logprob) for k, v in step.items()) for step in out.outputs[0].logprobs])
            for out in outputs]


def test_bf16_products_take_the_amx_kernel_up_to_the_limit_fused_or_not(amx_rows, fused_calls):
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", enable_prefix_caching=False)
    model = _model(llm)
    blocks = _blocks(model)
    assert blocks and all(b.uses_amx and b.amx_max_rows == DEFAULT_BF16_QUANTIZED_MAX_ROWS
                          for b in blocks)
    assert model.model.layer_stack.max_rows == DEFAULT_BF16_QUANTIZED_MAX_ROWS
    # 20 requests of different lengths: decode steps of 20 rows down to 1 (two row tiles of
    # the AMX kernel above 16), past the float32 kernels' 16; their prompts, 1,370 tokens
    # together, one first step above the limit.
    prompts = [prompt[: 40 + 3 * index]
               for index, prompt in enumerate(random_token_prompts(20, 100, 49152, seed=11))]
    assert sum(map(len, prompts)) > DEFAULT_BF16_QUANTIZED_MAX_ROWS
    expected = _generate(llm, prompts, fused=False)
    # Operator by operator: the decode steps' products (and the prompts' logits rows) on
    # the AMX kernel; the prompt chunks above the limit (the whole first step) on oneDNN.
    assert 20 in amx_rows and max(amx_rows) <= DEFAULT_BF16_QUANTIZED_MAX_ROWS
    assert fused_calls == []
    assert _generate(llm, prompts, fused=True) == expected
    assert max(fused_calls) == 20 and min(fused_calls) < 16


def test_amx_products_read_bf16_and_hand_on_bf16(monkeypatch):
    # Operator by operator the norms and SwiGLU round their results into bf16 for the AMX
    # block products as for oneDNN's, and the sums come back in bf16; a product of fewer
    # than AMX_MIN_ROWS rows (the float32 few-row kernel) reads and writes float32.
    seen: list[tuple[int, torch.dtype, torch.dtype]] = []
    original = QuantizedWeight.matmul

    def recording(self, x, *args, **kwargs):
        out = original(self, x, *args, **kwargs)
        if self.uses_amx:
            seen.append((x.shape[0], x.dtype, out.dtype))
        return out

    monkeypatch.setattr(QuantizedWeight, "matmul", recording)
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False)
    _model(llm).model.layer_stack.enabled = False
    prompts = random_token_prompts(3, 12, 49152, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert {rows for rows, _, _ in seen} >= {1, 3, 36}
    for rows, x_dtype, out_dtype in seen:
        expected = torch.float32 if rows < AMX_MIN_ROWS else torch.bfloat16
        assert (x_dtype, out_dtype) == (expected, expected), rows


def test_the_bf16_limit_sends_larger_products_to_onednn(amx_rows):
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False,
              bf16_quantized_max_rows=2)
    assert _model(llm).model.layer_stack.max_rows == 2
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for count in (4, 1):  # decode steps of 4 rows (oneDNN), then of 1 (the blocks)
        prompts = random_token_prompts(count, 12, 49152, seed=count)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert amx_rows and max(amx_rows) <= 2


def test_the_avx512_bf16_level_takes_the_vdpbf16ps_block_kernel():
    llm = LLM(dtype="bfloat16", cpu_isa="avx512_bf16", kv_cache_memory="64MiB")
    model = _model(llm)
    assert not any(b.uses_amx for b in _blocks(model))
    assert all(b.uses_dp for b in _blocks(model))
    assert model.model.layer_stack.max_rows == BF16_QUANTIZED_MAX_ROWS_DP


def test_the_amx_weights_are_the_bf16_models_dense_weights():
    # The AMX kernel's weights (x = I picks them) are the dense bf16 weights the model
    # loads: gguf's float32 dequantization rounded to bf16 (kept dense here: no oneDNN).
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", disable_onednn=True)
    layer = _model(llm).model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.bfloat16 and layer.blocks.uses_amx
    width = layer.weight.shape[1]
    assert torch.equal(layer.blocks.matmul(torch.eye(width)), layer.weight.float().T)


def test_batch_invariant_greedy_tokens_are_the_same_alone_and_among_others():
    """--batch-invariant: every product on the AMX block kernel, one row included, whose sums
    are each row's own in a fixed order (oneDNN's bf16 sums depend on the row count, and a
    row alone otherwise takes the float32 few-row kernel); attention is each row's own too.
    So a request's greedy tokens and logprobs are the same alone as among others."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", enable_prefix_caching=False,
              max_num_batched_tokens=256, batch_invariant=True)
    blocks = _blocks(_model(llm))
    assert blocks and all(b.uses_amx and b.amx_max_rows == 256 and b.amx_min_rows == 1
                          for b in blocks)
    vocab_size = llm.llm_engine.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": prompt}
               for prompt in random_token_prompts(6, 40, vocab_size, seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)

    def tokens(outputs):
        return [(list(out.outputs[0].token_ids),
                 [sorted((k, v.logprob) for k, v in step.items())
                  for step in out.outputs[0].logprobs])
                for out in outputs]

    # One prompt step of 240 rows and decode steps of 6, against steps of 40 rows and 1.
    together = tokens(llm.generate(prompts, params, use_tqdm=False))
    alone = [tokens(llm.generate([prompt], params, use_tqdm=False))[0] for prompt in prompts]
    assert together == alone


def test_batch_invariant_needs_the_budget_on_the_block_kernel():
    from tokenserve.engine.engine_args import EngineArgs

    config = EngineArgs(max_num_batched_tokens=256, batch_invariant=True).create_engine_config()
    assert config.kernel_config.bf16_quantized_max_rows == 256
    with pytest.raises(ValueError, match="at least max_num_batched_tokens"):
        EngineArgs(max_num_batched_tokens=256, bf16_quantized_max_rows=128,
                   batch_invariant=True).create_engine_config()
