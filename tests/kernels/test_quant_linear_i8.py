"""Few-row products of GGUF blocks with x rounded to 8 bits per block (kernels/csrc/quant_i8.h),
on every level this host has: vpdpbusd on the avx512_bf16 and amx levels (AVX512-VNNI),
vpmaddubsw and vpmaddwd on the avx2 and avx512 levels. The
kernel's result is W · x̂ in real arithmetic: gguf's dequantized weights times x rounded to
its blocks' 8-bit grid (dx = max |x| / 127 over the 32 values, q = x / dx rounded to nearest
even), so it is held to that product computed in float64, within float32 rounding of the
sums. How models route their products to it: tests/model/test_int8_activations.py."""

from __future__ import annotations

import pytest
import torch

from tests.gguf_blocks import random_quantized
from tests.kernels.conftest import select_level
from tokenserve.kernels import cpu_isa, quant_linear

KINDS = ("Q4_1", "Q8_0")


@pytest.fixture(scope="module", params=list(cpu_isa.ISA_LEVELS))
def cpu_isa_level(request: pytest.FixtureRequest):
    """Every x86-64 level (off x86-64 the "native" level builds no 8-bit kernel)."""
    yield from select_level(request.param)


@pytest.fixture(scope="module", autouse=True)
def ops(cpu_isa_level) -> quant_linear.QuantLinearOps:
    ops = quant_linear.load()
    assert ops is not None and ops.i8, f"the {cpu_isa_level} level's 8-bit kernel did not build"
    return ops


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded per 32-value block as the kernel rounds it, in float32 as it computes."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse)  # half to even, as vcvtps2dq
    assert q.abs().max() <= 127
    return (q * d).reshape(x.shape)


def check(weight, reference, x):
    y = weight.matmul(x, i8=True)
    exact = rounded(x).double() @ reference.double().T
    # Float32 sums of terms no larger than |x̂| · |W|: their rounding stays within ~K ulps.
    scale = rounded(x).abs().double() @ reference.abs().double().T
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= 1e-6 * scale + 1e-30).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 9])
# Widths of 1 to 5 blocks past whole groups (Q4_1: 4 blocks, Q8_0: 2), and the default
# model's 576 and 1536.
@pytest.mark.parametrize("in_features", [32, 64, 96, 128, 160, 576, 1536])
def test_the_kernel_is_the_product_of_x_rounded_to_8_bits(kind, num_rows, in_features):
    out_features = 37
    weight, reference = random_quantized(kind, out_features, in_features, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(in_features))
    check(weight, reference, x)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_of_zeros_and_of_wide_ranges(kind):
    weight, reference = random_quantized(kind, 16, 128, seed=3)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    x[0, :32] = 0.0  # a block of zeros: dx = 0, no division by it
    x[1, 32:64] *= 1e4  # one block far larger than its neighbours
    x[2, 64:96] *= 1e-6
    check(weight, reference, x)
    assert torch.isfinite(weight.matmul(x, i8=True)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_the_rounding_error_is_x_rounding_not_the_weights(kind):
    # Against the float product W · x: the difference is W · (x̂ - x), at most half a step
    # of each block's grid per value.
    weight, reference = random_quantized(kind, 64, 576, seed=5)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(6))
    error = (weight.matmul(x, i8=True).double() - x.double() @ reference.double().T).abs()
    step = x.reshape(4, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(4, 576)
    bound = (step.double() / 127 / 2) @ reference.abs().double().T
    assert (error <= bound * (1 + 1e-5) + 1e-6).all()
    assert error.max() > 0  # x was rounded


@pytest.mark.parametrize("kind", KINDS)
def test_rows_past_a_pass_and_slices_give_the_same_sums(kind):
    # The kernel carries 8 rows a pass (4 on AVX2); a row's sums do not depend on the others.
    weight, _ = random_quantized(kind, 48, 576, seed=8)
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(9))
    together = weight.matmul(x, i8=True)
    for row in range(19):
        assert torch.equal(weight.matmul(x[row : row + 1], i8=True), together[row : row + 1])


@pytest.mark.parametrize("kind,block_bytes", [("Q4_1", 320), ("Q8_0", 544)])
@pytest.mark.parametrize("out_features", [16, 37])
def test_the_copy_holds_the_files_bytes_in_panels_of_16_rows(ops, kind, block_bytes,
                                                            out_features):
    # Per panel of 16 output rows and 32-weight block: the 16 rows' weights (Q4_1: the
    # file's 16 nibble bytes a row, byte 64r + 4n + i = row n's byte 4r + i; Q8_0: its 32
    # bytes offset by 128, byte 64k + 4n + i = row n's weight 4k + i), then their float16
    # scales; rows past the weight's are zeros.
    weight, _ = random_quantized(kind, out_features, 96, seed=10)
    copy = ops.repack_i8(kind, weight.qs, weight.scales)
    panels = -(-out_features // 16)
    assert copy.dtype == torch.uint8 and copy.numel() == panels * 3 * block_bytes
    blocks = copy.reshape(panels, 3, block_bytes)
    per_row = 16 if kind == "Q4_1" else 32
    nibbles = blocks[:, :, : per_row * 16].reshape(panels, 3, per_row // 4, 16, 4)
    file_bytes = nibbles.permute(0, 3, 1, 2, 4).reshape(panels * 16, 3 * per_row)
    expected = weight.qs.view(torch.uint8)
    if kind == "Q8_0":
        expected = expected ^ 0x80
    assert torch.equal(file_bytes[:out_features], expected)
    scales = blocks[:, :, per_row * 16 :].contiguous().view(torch.float16).float()
    count = 2 if kind == "Q4_1" else 1
    scales = scales.reshape(panels, 3, count, 16).permute(0, 3, 1, 2).reshape(panels * 16, 3,
                                                                              count)
    assert torch.equal(scales[:out_features], weight.scales.reshape(out_features, 3, count))
    assert not scales[out_features:].any()
    if kind == "Q4_1":
        assert not file_bytes[out_features:].any()
    else:
        assert (file_bytes[out_features:] == 0x80).all()
