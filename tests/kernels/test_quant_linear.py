"""Products with GGUF block-quantized weights (kernels/csrc/quant_linear.c, model/quantized.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokenserve import kernels
from tokenserve.model.linear import linear, pack_weight
from tokenserve.model.quantized import QuantizedWeight

KINDS = ("Q4_1", "Q8_0")


def _quantized(kind: str, rows: int, width: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight in `kind` blocks, and gguf's own dequantization of those blocks."""
    weight = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    blocks = quantize(weight, GGMLQuantizationType[kind])
    reference = dequantize(blocks, GGMLQuantizationType[kind]).reshape(rows, width)
    return QuantizedWeight.from_blocks(kind, blocks), torch.from_numpy(reference.copy())


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    # The kernels are the default CPU path: on a machine with a C compiler they must build.
    assert kernels.quant_linear() is not None, "the C kernels did not build (see the log)"


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_hold_exactly_gguf_dequantized_weights(kind):
    weight, reference = _quantized(kind, rows=6, width=96)
    assert weight.shape == (6, 96)
    assert torch.equal(weight.dequantize(), reference)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize("out_features,in_features", [(2, 32), (6, 96), (64, 160)])
def test_kernel_equals_float_product(kind, num_rows, out_features, in_features):
    weight, reference = _quantized(kind, out_features, in_features, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    expected = (x.double() @ reference.double().T).float()
    torch.testing.assert_close(weight.matmul(x), expected, rtol=1e-5, atol=1e-5)


def test_kernel_reads_a_non_contiguous_input():
    weight, reference = _quantized("Q4_1", 4, 64)
    x = torch.randn(64, 3).T  # [3, 64], transposed view
    torch.testing.assert_close(weight.matmul(x), x @ reference.T, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_mismatched_shapes():
    weight, _ = _quantized("Q4_1", 3, 64)  # an odd number of output rows
    with pytest.raises(ValueError, match="even number of output rows"):
        weight.matmul(torch.randn(2, 64))
    weight, _ = _quantized("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="match x's width"):
        weight.matmul(torch.randn(2, 96))


def test_concat_stacks_rows_and_refuses_mixed_kinds():
    first, first_reference = _quantized("Q4_1", 4, 64, seed=1)
    second, second_reference = _quantized("Q4_1", 2, 64, seed=2)
    fused = QuantizedWeight.concat([first, second])
    assert torch.equal(fused.dequantize(), torch.cat([first_reference, second_reference]))
    other, _ = _quantized("Q8_0", 2, 64)
    assert QuantizedWeight.concat([first, other]) is None


def test_linear_uses_the_quantized_copy_up_to_max_rows_only():
    # A quantized copy that deliberately differs from the float weight shows which one ran.
    float_weight = torch.randn(8, 64)
    quantized, reference = _quantized("Q8_0", 8, 64)
    quantized.max_rows = 4
    packed = pack_weight(float_weight)
    few, many = torch.randn(4, 64), torch.randn(5, 64)
    bias = torch.randn(8)
    torch.testing.assert_close(
        linear(few, float_weight, bias, packed, quantized), few @ reference.T + bias,
        rtol=1e-5, atol=1e-5,
    )
    torch.testing.assert_close(
        linear(many, float_weight, bias, packed, quantized), many @ float_weight.T + bias,
        rtol=1e-5, atol=1e-5,
    )
