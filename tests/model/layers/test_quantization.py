"""The quantization methods (model/layers/quantization/): dense weights prepacked for oneDNN
(the dense copy freed; at load, or by the first product that reads the packed form), and a GGUF model's blocks kept beside them, whose products of few
rows equal the dense product on gguf's dequantized weights, routed by rows to the few-row
kernel, the many-row kernel, then oneDNN; the method chosen from the model's format."""

from __future__ import annotations

import pytest
import torch

from tests.gguf_blocks import random_quantized
from tokenserve.config import KernelConfig
from tokenserve.kernels import quant_linear
from tokenserve.model.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenserve.model.layers.quantization import (
    GGUFLinearMethod,
    UnquantizedLinearMethod,
    get_linear_method,
)
from tokenserve.model.layers.quantization.gguf import QuantizedWeight


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert quant_linear.load() is not None, "the C kernels did not build (see the log)"


def test_unquantized_method_packs_for_onednn_and_frees_the_dense_weight():
    weight, x = torch.randn(16, 64), torch.randn(5, 64)
    dense = ReplicatedLinear(64, 16, quant_method=UnquantizedLinearMethod(use_onednn=False))
    packed = ReplicatedLinear(64, 16, quant_method=UnquantizedLinearMethod(use_onednn=True))
    for layer in (dense, packed):
        layer.weight.weight_loader(layer.weight, weight)
        layer.quant_method.process_weights_after_loading(layer)
    assert dense.packed_weight is None and torch.equal(dense.weight, weight)
    assert packed.packed_weight is not None and packed.weight.numel() == 0
    torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_dtype", [None, torch.bfloat16])
def test_a_packing_left_for_later_is_done_by_the_first_product_that_reads_it(weight_dtype):
    # get_model(pack_weights=False): the same products as packed at load, packed later.
    generator = torch.Generator().manual_seed(1)
    weight, x = torch.randn(48, 64, generator=generator), torch.randn(9, 64, generator=generator)
    now, later = (
        ReplicatedLinear(64, 48, quant_method=UnquantizedLinearMethod(weight_dtype=weight_dtype))
        for _ in range(2)
    )
    for layer, pack in ((now, True), (later, False)):
        layer.weight.weight_loader(layer.weight, weight)
        layer.quant_method.process_weights_after_loading(layer, pack=pack)
    # (oneDNN packs no bf16 weight on a CPU without native bf16: both stay dense there.)
    packs = now.packed_weight is not None
    assert not now.packing_pending
    assert later.packed_weight is None and later.packing_pending
    # The operator before hands the input the packed weight will read.
    assert later.input_dtype(9) == now.input_dtype(9)
    assert torch.equal(later(x), now(x))
    assert (later.packed_weight is not None) == packs and not later.packing_pending
    assert later.weight.numel() == now.weight.numel()  # the dense copy freed, as at load
    packed = later.packed_weight
    later.quant_method.pack_weight(later)  # once only
    assert later.packed_weight is packed


def test_a_packing_that_changes_the_weights_dtype_is_not_left_for_later():
    # A bf16 model's tied head: the float32 embedding table is its weight, packed in bf16,
    # which changes what its products read: packed at load whatever pack says.
    method = UnquantizedLinearMethod(weight_dtype=torch.bfloat16)
    head = ReplicatedLinear(64, 48, quant_method=method)
    head.weight = torch.nn.Parameter(torch.randn(48, 64), requires_grad=False)
    head.keep_dense_weight = True
    method.process_weights_after_loading(head, pack=False)
    assert not head.packing_pending
    reads = head.input_dtype(9)
    head(torch.randn(9, 64, dtype=reads or torch.float32))
    assert head.input_dtype(9) == reads


def test_a_gguf_layer_left_to_pack_multiplies_few_rows_by_its_blocks_and_packs_for_many():
    blocks, reference = random_quantized("Q4_1", 32, 96)
    method = GGUFLinearMethod(max_rows=4, gemm_max_rows=16, use_onednn=True)
    layer = ReplicatedLinear(96, 32, quant_method=method)
    layer.weight.weight_loader(layer.weight, reference)
    layer.weight.weight_loader(layer.weight, blocks)
    method.process_weights_after_loading(layer, pack=False)
    assert layer.blocks is not None and layer.packing_pending
    generator = torch.Generator().manual_seed(2)
    few, many = torch.randn(3, 96, generator=generator), torch.randn(40, 96, generator=generator)
    for x in (few, many):
        expected = (x.double() @ reference.double().T).float()
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
        assert layer.packing_pending == (x is few)


@pytest.mark.parametrize("use_onednn", [True, False])
def test_bf16_weights_multiply_float32_activations_rounded_to_bf16(use_onednn):
    # A bfloat16 model (model/precision.py): bf16 weights, float32 in and out, the bias
    # added in float32 after the product.
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 64, generator=generator), torch.randn(9, 64, generator=generator)
    bias = torch.randn(48, generator=generator)
    method = UnquantizedLinearMethod(use_onednn=use_onednn, weight_dtype=torch.bfloat16)
    layer = ReplicatedLinear(64, 48, bias=True, quant_method=method)
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.data.copy_(bias)
    method.process_weights_after_loading(layer)
    stored = layer.weight if layer.packed_weight is None else layer.packed_weight
    assert stored.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32
    out = layer(x)
    assert out.dtype == torch.float32
    # What it computes: bf16-rounded inputs and weights, products summed in float32, the
    # sum rounded to bf16 once (oneDNN writes its input dtype): within 2^-8 relative.
    expected = x.bfloat16().double() @ weight.bfloat16().double().T + bias.double()
    torch.testing.assert_close(out, expected.float(), rtol=1e-2, atol=1e-2)
    # bf16 rounding did happen (not a float32 product).
    assert (out - (x @ weight.T + bias)).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("num_rows", [1, 4, 7, 16, 40])
def test_gguf_method_equals_the_dense_product_on_dequantized_weights(kind, num_rows):
    blocks, reference = random_quantized(kind, 32, 96)
    bias = torch.randn(32)
    method = GGUFLinearMethod(max_rows=4, gemm_max_rows=16, use_onednn=True)
    layer = ReplicatedLinear(96, 32, bias=True, quant_method=method)
    layer.weight.weight_loader(layer.weight, reference)  # the dense form, as gguf expands it
    layer.weight.weight_loader(layer.weight, blocks)  # and the file's blocks
    layer.bias.weight_loader(layer.bias, bias)
    method.process_weights_after_loading(layer)
    assert layer.blocks is not None and layer.packed_weight is not None
    x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(num_rows))
    expected = (x.double() @ reference.double().T + bias.double()).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_gguf_method_routes_by_rows_to_each_kernel_then_onednn(monkeypatch):
    # Blocks that deliberately differ from the dense weight show which one ran.
    dense_weight = torch.randn(16, 64)
    blocks, reference = random_quantized("Q8_0", 16, 64)
    method = GGUFLinearMethod(max_rows=4, gemm_max_rows=8)
    layer = ReplicatedLinear(64, 16, bias=True, quant_method=method)
    layer.weight.weight_loader(layer.weight, dense_weight)
    layer.weight.weight_loader(layer.weight, blocks)
    bias = torch.randn(16)
    layer.bias.weight_loader(layer.bias, bias)
    method.process_weights_after_loading(layer)
    kernels_run: list[bool] = []
    original = QuantizedWeight.matmul

    def recording(self, x, panels=None):
        kernels_run.append(x.shape[0] > self.max_rows)
        return original(self, x, panels)

    monkeypatch.setattr(QuantizedWeight, "matmul", recording)
    for num_rows, expected_weight, expected_kernels in [
        (4, reference, [False]),  # the few-row kernel
        (5, reference, [True]),  # the many-row kernel
        (8, reference, [True]),
        (9, dense_weight, []),  # oneDNN
    ]:
        kernels_run.clear()
        x = torch.randn(num_rows, 64)
        torch.testing.assert_close(layer(x), x @ expected_weight.T + bias, rtol=1e-5, atol=1e-5)
        assert kernels_run == expected_kernels, num_rows


def test_gguf_blocks_of_merged_parts_join_only_whole_and_of_one_kind():
    (q, q_ref), (k, k_ref), (v, v_ref) = (random_quantized("Q4_1", rows, 64, seed)
                                          for seed, rows in enumerate((32, 16, 16)))
    method = GGUFLinearMethod(max_rows=4, gemm_max_rows=8)
    layer = QKVParallelLinear(64, 16, 2, 1, quant_method=method)
    for shard_id, blocks, reference in (("v", v, v_ref), ("q", q, q_ref), ("k", k, k_ref)):
        layer.weight.weight_loader(layer.weight, reference, shard_id)
        layer.weight.weight_loader(layer.weight, blocks, shard_id)
    method.process_weights_after_loading(layer)
    assert torch.equal(layer.blocks.dequantize(), torch.cat([q_ref, k_ref, v_ref]))
    assert (layer.blocks.max_rows, layer.blocks.gemm_max_rows) == (4, 8)

    other = random_quantized("Q8_0", 16, 64)[0]
    for parts in ({"q": q, "k": k}, {"q": q, "k": k, "v": other}):  # a part missing; mixed kinds
        layer = QKVParallelLinear(64, 16, 2, 1, quant_method=method)
        for shard_id, blocks in parts.items():
            layer.weight.weight_loader(layer.weight, blocks, shard_id)
        method.process_weights_after_loading(layer)
        assert layer.blocks is None  # the dense weight alone


def test_gguf_blocks_shard_like_the_dense_weight():
    blocks, reference = random_quantized("Q4_1", 32, 128)
    for rank in (0, 1):
        method = GGUFLinearMethod(max_rows=4, gemm_max_rows=8, use_onednn=False)
        layer = RowParallelLinear(128, 32, quant_method=method, tp_size=2, tp_rank=rank,
                                  reduce_results=False)
        layer.weight.weight_loader(layer.weight, reference)
        layer.weight.weight_loader(layer.weight, blocks)
        method.process_weights_after_loading(layer)
        assert torch.equal(layer.blocks.dequantize(), layer.weight)


def test_the_method_follows_the_model_format_and_the_kernel_settings():
    gguf, hf = "gguf", "hf"
    assert isinstance(get_linear_method(gguf, torch.float32, KernelConfig()), GGUFLinearMethod)
    # bfloat16: bf16 dense weights (float32 activations) beside the blocks.
    bf16 = get_linear_method(gguf, torch.bfloat16, KernelConfig())
    assert isinstance(bf16, GGUFLinearMethod) and bf16.weight_dtype == torch.bfloat16
    # ... whose rows stop at bf16_quantized_max_rows: oneDNN's bf16 GEMM above.
    assert (bf16.max_rows, bf16.gemm_max_rows) == (
        KernelConfig().quantized_max_rows, KernelConfig().bf16_block_max_rows("float32"))
    assert KernelConfig().block_row_limits(False) == (
        KernelConfig().quantized_max_rows, KernelConfig().quantized_gemm_max_rows)
    capped = get_linear_method(gguf, torch.bfloat16, KernelConfig(bf16_quantized_max_rows=4))
    assert (capped.max_rows, capped.gemm_max_rows) == (4, 4)
    assert get_linear_method(gguf, torch.float32, KernelConfig(bf16_quantized_max_rows=0)).\
        gemm_max_rows == KernelConfig().quantized_gemm_max_rows
    for model_format, dtype, config in [
        (hf, torch.float32, KernelConfig()),
        (gguf, torch.float16, KernelConfig()),
        (gguf, torch.bfloat16, KernelConfig(quantized_max_rows=0, quantized_gemm_max_rows=0)),
        (gguf, torch.bfloat16, KernelConfig(bf16_quantized_max_rows=0)),
        (gguf, torch.float32, KernelConfig(disable_c_kernels=True)),
        (gguf, torch.float32, KernelConfig(quantized_max_rows=0, quantized_gemm_max_rows=0)),
    ]:
        method = get_linear_method(model_format, dtype, config)
        assert type(method) is UnquantizedLinearMethod
    assert get_linear_method(hf, torch.bfloat16, KernelConfig()).weight_dtype == torch.bfloat16
    assert not get_linear_method(hf, torch.float32, KernelConfig(disable_onednn=True)).use_onednn
    with pytest.raises(ValueError, match="quantized_max_rows must be a non-negative integer"):
        KernelConfig(quantized_max_rows=-1)
    with pytest.raises(ValueError, match="bf16_quantized_max_rows must be a non-negative"):
        KernelConfig(bf16_quantized_max_rows=-1)
