"""Products with GGUF block-quantized weights (kernels/csrc/quant_linear.c, and the weights' block
form in model/layers/quantization/gguf.py), for every instruction set the host has. How the GGUF method routes a layer's products:
tests/model/layers/test_quantization.py."""

from __future__ import annotations

import pytest
import torch

from tests.gguf_blocks import random_quantized
from tokenserve.kernels import quant_linear
from tokenserve.model.layers.quantization.gguf import QuantizedWeight

KINDS = ("Q4_1", "Q8_0")




@pytest.fixture(scope="module", autouse=True)
def built(cpu_isa_level) -> None:
    # Once per instruction set (conftest.py); each test's weights bind the selected build.
    # The kernels are the default CPU path: on a machine with a C compiler they must build.
    assert quant_linear.load() is not None, "the C kernels did not build (see the log)"


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_hold_exactly_gguf_dequantized_weights(kind):
    weight, reference = random_quantized(kind, rows=6, width=96)
    assert weight.shape == (6, 96)
    assert torch.equal(weight.dequantize(), reference)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize("out_features,in_features", [(2, 32), (3, 64), (6, 96), (64, 160)])
def test_kernel_equals_float_product(kind, num_rows, out_features, in_features):
    weight, reference = random_quantized(kind, out_features, in_features, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    expected = (x.double() @ reference.double().T).float()
    torch.testing.assert_close(weight.matmul(x), expected, rtol=1e-5, atol=1e-5)


def test_kernel_reads_a_non_contiguous_input():
    weight, reference = random_quantized("Q4_1", 4, 64)
    x = torch.randn(64, 3).T  # [3, 64], transposed view
    torch.testing.assert_close(weight.matmul(x), x @ reference.T, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_mismatched_shapes():
    weight, _ = random_quantized("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="match x's width"):
        weight.matmul(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float32"):
        weight.matmul(torch.randn(2, 64, dtype=torch.float64))
    weight, _ = random_quantized("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="match x's width"):
        weight.matmul(torch.randn(2, 96))


def test_concat_stacks_rows_and_refuses_mixed_kinds():
    first, first_reference = random_quantized("Q4_1", 4, 64, seed=1)
    second, second_reference = random_quantized("Q4_1", 2, 64, seed=2)
    fused = QuantizedWeight.concat([first, second])
    assert torch.equal(fused.dequantize(), torch.cat([first_reference, second_reference]))
    other, _ = random_quantized("Q8_0", 2, 64)
    assert QuantizedWeight.concat([first, other]) is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_features", [576, 1536])
@pytest.mark.parametrize("num_rows", [1, 5, 6, 7, 13, 64, 65])
def test_many_row_kernel_equals_float_product(kind, in_features, num_rows):
    # 32 output rows: two panels; 576 inputs: three K slices, 1536: six.
    weight, reference = random_quantized(kind, 32, in_features, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ reference.double().T
    # Float32 sums of in_features products: bounded relative to the sum of magnitudes.
    bound = 1e-6 * (x.double().abs() @ reference.double().abs().T)
    error = (weight.matmul(x, panels=True).double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("panels", [False, True])
def test_kernels_expand_exactly_gguf_dequantized_weights(kind, panels):
    # x = I picks W's columns: each output is 1 * w plus exact zeros, so any difference in
    # the expanded weights (arithmetic or layout) shows.
    weight, reference = random_quantized(kind, 48, 576)
    assert torch.equal(weight.matmul(torch.eye(576), panels=panels), reference.T)


def test_many_row_kernel_refuses_output_rows_off_its_panels():
    weight, reference = random_quantized("Q8_0", 24, 64)  # not a multiple of 16
    x = torch.randn(30, 64)
    with pytest.raises(ValueError, match="multiple of 16 output rows"):
        weight.matmul(x, panels=True)
    # By default the product falls back to the few-row kernel.
    torch.testing.assert_close(weight.matmul(x), x @ reference.T, rtol=1e-5, atol=1e-5)


def test_narrow_takes_rows_and_whole_blocks_of_columns():
    for kind in KINDS:
        weight, reference = random_quantized(kind, 8, 128)
        assert torch.equal(weight.narrow(0, 2, 4).dequantize(), reference[2:6])
        assert torch.equal(weight.narrow(1, 64, 64).dequantize(), reference[:, 64:])
        with pytest.raises(ValueError, match="whole 32-weight blocks"):
            weight.narrow(1, 16, 64)
