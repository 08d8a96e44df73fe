"""The bfloat16 hand-offs of csrc/layer_ops.c (a bf16 model's norms and SwiGLU reading and
writing its products' bf16): bit for bit the float32 kernel followed by torch's cast (the
path they replace), and close to plain PyTorch; each built for every instruction set the
host has (conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenserve.kernels import layer_ops

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def ops(cpu_isa_level) -> layer_ops.LayerOps:
    loaded = layer_ops.load()
    assert loaded is not None, "the C kernels did not build (see the warning in the log)"
    return loaded


def _reference_rms_norm(x, weight, eps, residual):
    source = residual.add_(x.float()) if residual is not None else x.float()
    return weight * (source * torch.rsqrt(source.pow(2).mean(-1, keepdim=True) + eps))


# 2048 rows: split over the threads; 1100: wider than the kernel's stack row buffer.
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (2048, 96), (3, 1100)])
@pytest.mark.parametrize("x_dtype", [F32, BF16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_to_bf16_is_the_float32_kernel_then_the_cast(
    ops, rows, hidden, x_dtype, with_residual
):
    generator = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=generator) * 3).to(x_dtype)
    weight = torch.randn(hidden, generator=generator)
    residual = torch.randn(rows, hidden, generator=generator) if with_residual else None
    expected_residual = None if residual is None else residual.clone()

    out = ops.rms_norm(x, weight, 1e-5, residual, BF16)
    float_out = ops.rms_norm(x.float(), weight, 1e-5, expected_residual, F32)

    assert out.dtype == BF16 and out.shape == x.shape
    assert torch.equal(out, float_out.to(BF16))
    if with_residual:
        assert torch.equal(residual, expected_residual)  # the stream, added in float32
    if not with_residual:
        reference = _reference_rms_norm(x, weight, 1e-5, None)
        torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.01)


@pytest.mark.parametrize("rows", [1, 64])
def test_rms_norm_reads_bf16_into_a_float32_result(ops, rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator).to(BF16)
    weight = torch.randn(576, generator=generator)
    residual = torch.randn(rows, 576, generator=generator)
    expected = _reference_rms_norm(x, weight, 1e-6, residual.clone())

    out = ops.rms_norm(x, weight, 1e-6, residual, F32)

    assert out.dtype == F32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,d", [(1, 8), (5, 1536), (300, 100), (2, 13)])
@pytest.mark.parametrize("in_dtype", [F32, BF16])
def test_silu_and_mul_to_bf16_is_the_float32_kernel_then_the_cast(ops, rows, d, in_dtype):
    generator = torch.Generator().manual_seed(rows * d)
    gate_up = (torch.randn(rows, 2 * d, generator=generator) * 4).to(in_dtype)

    out = ops.silu_and_mul(gate_up, BF16)

    assert out.dtype == BF16 and out.shape == (rows, d)
    assert torch.equal(out, ops.silu_and_mul(gate_up.float()).to(BF16))
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, atol=0.05, rtol=0.01)


def test_the_bf16_rounding_is_to_nearest_even_as_torch_rounds(ops):
    # Halfway cases, both neighbours, infinities and NaN as rms_norm's weights scale them.
    values = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -(1.0 + 2**-8),
                           float("inf"), float("-inf"), float("nan"), 3.0e38])
    x = torch.ones(1, 8)  # a row of ones normalises to ones: out = weight
    out = ops.rms_norm(x, values, 0.0, None, BF16)
    expected = values.to(BF16)
    assert torch.equal(out[0, :6], expected[:6]) and out[0, 7] == expected[7]
    assert torch.isnan(out[0, 6])


def test_bad_dtypes_are_refused(ops):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.float16), torch.ones(8), 1e-5, None, BF16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5, None, torch.float16)


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 2, 1, 8), (9, 9, 3, 64),
                                                       (700, 4, 2, 16)])
def test_rotary_from_bf16_is_the_cast_then_rotary(ops, tokens, heads, kv_heads, dim):
    generator = torch.Generator().manual_seed(tokens)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width, generator=generator).to(BF16)
    positions = torch.randint(0, 100, (tokens,), generator=generator)
    angles = torch.rand(100, dim // 2, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)

    out = ops.rotary_from_bf16(qkv, positions, cos, sin, heads, kv_heads)

    expected = qkv.float()
    q = expected[:, : heads * dim].view(tokens, heads, dim)
    k = expected[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    ops.rotary(q, k, positions, cos, sin)
    assert out.dtype == F32 and torch.equal(out, expected)
    # Against plain PyTorch's rotate-half.
    half = dim // 2
    x = qkv.float()[:, : heads * dim].view(tokens, heads, dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotated = x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s
    torch.testing.assert_close(out[:, : heads * dim].view(tokens, heads, dim), rotated)
    assert torch.equal(out[:, (heads + kv_heads) * dim :], qkv.float()[:, (heads + kv_heads) * dim :])


# Rows split into the build's widest vectors, then eight lanes, then single values (widths
# 16 + 8 + 5 on an AVX-512 build); NaN, infinities and values past exp's clamp included.
@pytest.mark.parametrize("d", [24, 29, 1536])
@pytest.mark.parametrize("in_dtype", [F32, BF16])
def test_silu_and_mul_to_bf16_every_lane_width_and_special_values(ops, d, in_dtype):
    generator = torch.Generator().manual_seed(d)
    gate_up = torch.randn(6, 2 * d, generator=generator) * 30
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e30, -200.0,
                             100.0, -1e-30])
    gate_up[0, : len(specials)] = specials  # gates, each lane width
    gate_up[1, d - len(specials) : d] = specials
    gate_up[2, d : d + len(specials)] = specials  # ups
    gate_up = gate_up.to(in_dtype)

    out = ops.silu_and_mul(gate_up, BF16)

    expected = ops.silu_and_mul(gate_up.float()).to(BF16)
    # Bit for bit, a NaN where it gives one (the kernel's NaN is the quiet one, as bf16_round).
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(out).any()


# Every bf16 gate (its 65536 bit patterns) through the table (silu_table.h), the rest of a row
# (8 lanes, then single values: 13 more) included; the width rotated so each gate meets
# each lane position.
@pytest.mark.parametrize("shift", [0, 5])
def test_silu_and_mul_table_is_the_computed_silu_for_every_bf16_gate(ops, shift):
    generator = torch.Generator().manual_seed(shift)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16)
    gates = torch.cat([every, every[:13]]).roll(shift)
    ups = (torch.randn(len(gates), generator=generator) * 3).to(BF16)
    gate_up = torch.cat([gates, ups]).unsqueeze(0)

    out = ops.silu_and_mul(gate_up, BF16)

    expected = ops.silu_and_mul(gate_up.float()).to(BF16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(out).sum() == torch.isnan(expected).sum() > 0
