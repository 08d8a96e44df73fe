"""A bfloat16 GGUF model on the avx512_bf16 level (AVX512_BF16 without AMX, or that level
forced): its products of at most `bf16_quantized_max_rows` rows (16 there by default) read
the GGUF blocks through the vdpbf16ps kernel (kernels/csrc/quant_dp.h) with the model's bf16
numerics, from one row; decode steps up to that many rows run fused with the same results
as operator by operator."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_bf16_amx import _blocks, _generate, _model
from tokenserve import LLM
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.config import BF16_QUANTIZED_MAX_ROWS_WITHOUT_AMX
from tokenserve.kernels import cpu_isa

pytestmark = pytest.mark.skipif(
    not set(cpu_isa.ISA_LEVELS["avx512_bf16"][0]) <= cpu_isa.cpu_flags(),
    reason="no AVX512_BF16 on this CPU",
)


@pytest.fixture
def dp_rows(block_rows_where) -> list[int]:
    """The rows of every product on the vdpbf16ps block kernel."""
    return block_rows_where(lambda weight: weight.uses_dp)


def test_bf16_products_take_the_vdpbf16ps_kernel_up_to_the_limit_fused_or_not(dp_rows,
                                                                              fused_calls):
    llm = LLM(dtype="bfloat16", cpu_isa="avx512_bf16", kv_cache_memory="128MiB",
              enable_prefix_caching=False)
    model = _model(llm)
    blocks = _blocks(model)
    assert blocks and all(b.uses_dp and not b.uses_amx
                          and b.dp_max_rows == BF16_QUANTIZED_MAX_ROWS_WITHOUT_AMX
                          for b in blocks)
    assert model.model.layer_stack.max_rows == BF16_QUANTIZED_MAX_ROWS_WITHOUT_AMX
    # 12 requests of different lengths and output lengths: decode steps of 12 rows and fewer.
    prompts = [prompt[: 10 + 3 * index]
               for index, prompt in enumerate(random_token_prompts(12, 50, 49152, seed=11))]
    expected = _generate(llm, prompts, fused=False)
    assert 12 in dp_rows and min(dp_rows) < 12
    assert max(dp_rows) <= BF16_QUANTIZED_MAX_ROWS_WITHOUT_AMX
    assert fused_calls == []
    assert _generate(llm, prompts, fused=True) == expected
    assert max(fused_calls) == 12 and min(fused_calls) < 12


def test_the_vdpbf16ps_weights_are_the_bf16_models_dense_weights():
    # x = I picks the kernel's weights: the dense bf16 weights the model loads, gguf's
    # float32 dequantization rounded to bf16 (kept dense here: no oneDNN).
    llm = LLM(dtype="bfloat16", cpu_isa="avx512_bf16", kv_cache_memory="64MiB",
              disable_onednn=True)
    layer = _model(llm).model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.bfloat16 and layer.blocks.uses_dp
    width = layer.weight.shape[1]
    assert torch.equal(layer.blocks.matmul(torch.eye(width)), layer.weight.float().T)
