"""A bfloat16 GGUF model on the avx512_bf16 level (AVX512_BF16 without AMX, or that level
forced): its products of at most `bf16_quantized_max_rows` rows (128 there by default) read
the GGUF blocks through the vdpbf16ps kernel (kernels/csrc/quant_dp.h) with the model's bf16
numerics, from one row, in its panel form above DP_FEW_ROWS rows; decode steps up to that
many rows run fused with the same results as operator by operator."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_bf16_amx import _blocks, _generate, _model
from tokenserve import LLM
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.config import BF16_QUANTIZED_MAX_ROWS_DP
from tokenserve.kernels import cpu_isa
from tokenserve.kernels.quant_linear import BoundQuantLinear
from tokenserve.model.layers.quantization.gguf import DP_FEW_ROWS

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
                          and b.dp_max_rows == BF16_QUANTIZED_MAX_ROWS_DP
                          for b in blocks)
    assert model.model.layer_stack.max_rows == BF16_QUANTIZED_MAX_ROWS_DP
    # 12 requests of different lengths and output lengths: decode steps of 12 rows and fewer.
    prompts = [prompt[: 10 + 3 * index]
               for index, prompt in enumerate(random_token_prompts(12, 50, 49152, seed=11))]
    expected = _generate(llm, prompts, fused=False)
    assert 12 in dp_rows and min(dp_rows) < 12
    assert max(dp_rows) <= BF16_QUANTIZED_MAX_ROWS_DP
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


def test_decode_steps_above_the_few_row_limit_take_the_panel_form_fused_or_not(
        dp_rows, fused_calls, monkeypatch):
    # 24 requests: decode steps of up to 24 rows, above DP_FEW_ROWS: the vdpbf16ps kernel's
    # panel form, one by one (the bindings) and fused (decode_layer.c), with the same
    # tokens and logprobs bit for bit.
    panel_rows: list[int] = []
    original = BoundQuantLinear.__call__

    def recording(self, x, panels=False, amx=False, dp=False, dp_panels=False):
        if dp_panels:
            panel_rows.append(x.shape[0])
        return original(self, x, panels, amx, dp, dp_panels)

    monkeypatch.setattr(BoundQuantLinear, "__call__", recording)
    llm = LLM(dtype="bfloat16", cpu_isa="avx512_bf16", kv_cache_memory="128MiB",
              enable_prefix_caching=False)
    prompts = [prompt[: 8 + 2 * index]
               for index, prompt in enumerate(random_token_prompts(24, 60, 49152, seed=12))]
    expected = _generate(llm, prompts, fused=False)
    assert 24 in dp_rows and 24 in panel_rows and min(panel_rows) > DP_FEW_ROWS
    assert fused_calls == []
    panel_rows.clear()
    assert _generate(llm, prompts, fused=True) == expected
    assert 24 in fused_calls and max(fused_calls) == 24
