"""The bf16 kernels on GGUF blocks: a bfloat16 model's products with its numerics (each weight
expanded as gguf dequantizes it, then rounded to bf16; x rounded to bf16; float32 sums,
each rounded to bf16 at the end as oneDNN's bf16 GEMM hands its sums on), on AMX tiles on
the amx level (kernels/csrc/quant_amx.h) and by vdpbf16ps on the avx512_bf16 level
(kernels/csrc/quant_dp.h: its dot-product form, "dp", and its panel form, "dp_panels"), each
test once per kernel the host runs. How a bf16 model routes
its products to them: tests/model/test_bf16_amx.py, tests/model/test_bf16_decode.py.

Tolerance of the sums. Every product of two bf16 values is exact in float32 (8 + 8
significant bits), so the only error before the last rounding is the float32 summation of
K terms: at most (K - 1) · 2^-24 · Σ|w·x| in any order. The tests hold the kernel's float32
sum to K · 2^-24 · Σ|w·x| of a float64 sum of the same bf16 operands (and twice that of
torch's own float32 product of them, two such sums): each output must be a bf16 value
between the bf16 roundings of the bounds (rounding is monotone). That is ~1e-4 relative at
K = 1536, ~40x tighter than one bf16 rounding (2^-9); x = I and W = I pick weights and
inputs out exactly, so a weight or input rounded any other way shows bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_blocks import random_quantized
from tokenserve.kernels import build, cpu_isa, quant_linear
from tokenserve.model.layers.quantization.gguf import QuantizedWeight

KINDS = ("Q4_1", "Q8_0")


# Each bf16 kernel and the level whose build has it.
LEVELS = {"amx": "amx", "dp": "avx512_bf16", "dp_panels": "avx512_bf16"}
# The QuantLinearOps flag that says whether a kernel runs.
FLAGS = {"amx": "amx", "dp": "dp", "dp_panels": "dp"}


@pytest.fixture(scope="module", autouse=True, params=list(LEVELS))
def kernel(request) -> str:
    name, level = request.param, LEVELS[request.param]
    missing = sorted(set(cpu_isa.ISA_LEVELS[level][0]) - cpu_isa.cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {level} (no {', '.join(missing)} in /proc/cpuinfo)")
    previous = build.selected_isa()
    build.select_isa(level)
    ops = quant_linear.load()
    assert ops is not None and getattr(ops, FLAGS[name]), f"the {level} build did not run {name}"
    assert not (ops.amx and ops.dp)
    yield name
    build.select_isa(previous)


def _bf16(weight: QuantizedWeight, x: torch.Tensor, kernel: str) -> torch.Tensor:
    return weight._kernels(x, **{kernel: True})


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """K · 2^-24 · Σ|w·x| per output, for the bf16 operands x [M, K], w [N, K]."""
    return x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)


def _rounded_within(out: torch.Tensor, centre: torch.Tensor, bound: torch.Tensor) -> bool:
    """Whether each of `out` is some float32 within `bound` of `centre` (float64), rounded
    to bf16: a bf16 value between the bf16 roundings of float32s at or outside the bounds."""
    low, high = (centre - bound).float(), (centre + bound).float()
    low = torch.where(low.double() > centre - bound, torch.nextafter(low, low - 1), low)
    high = torch.where(high.double() < centre + bound, torch.nextafter(high, high + 1), high)
    low, high = low.bfloat16().float(), high.bfloat16().float()
    return bool(torch.equal(out.bfloat16().float(), out) and (low <= out).all()
                and (out <= high).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_rows", [1, 3, 7, 8, 16, 17, 64, 65, 130])
# 16, 48, 32 and 80 output rows: panels of 1, 3 and 2 vectors of 16 and one of each.
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 576), (32, 1536), (80, 64)])
def test_the_kernel_sums_the_bf16_operands(kernel, kind, num_rows, out_features,
                                           in_features):
    weight, reference = random_quantized(kind, out_features, in_features, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    xb, wb = x.bfloat16(), reference.bfloat16()
    out = _bf16(weight, x, kernel)
    assert out.dtype == torch.float32 and out.shape == (num_rows, out_features)
    bound = _bound(xb, wb)
    assert _rounded_within(out, xb.double() @ wb.double().T, bound)
    # torch's product of the same bf16 operands in float32 (its own order of the sums).
    assert _rounded_within(out, (xb.float() @ wb.float().T).double(), 2 * bound)


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_hands_on_what_onednns_bf16_product_does(kernel, kind):
    # A bf16 model's larger products take oneDNN's bf16 GEMM on the dense bf16 weight,
    # which rounds each float32 sum to bf16: the kernel's outputs are those very values
    # wherever the two orders of the float32 sums round alike (all but ~1e-4 of them here:
    # sums on a rounding boundary), both within the bound of the exact sum elsewhere.
    weight, reference = random_quantized(kind, 1536, 576, seed=11)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(12))
    xb, wb = x.bfloat16(), reference.bfloat16()
    out = _bf16(weight, x, kernel)
    onednn = torch.nn.functional.linear(xb, wb).float()
    assert (out == onednn).double().mean() > 0.999
    exact, bound = xb.double() @ wb.double().T, _bound(xb, wb)
    assert _rounded_within(onednn, exact, bound) and _rounded_within(out, exact, bound)


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_expands_weights_to_the_bf16_of_gguf_dequantization(kernel, kind):
    # x = I picks W's columns exactly (1 · w plus exact zeros): the kernel's weights must be
    # bit for bit gguf's float32 dequantization rounded to bf16 as torch rounds it.
    weight, reference = random_quantized(kind, 48, 576, seed=7)
    out = _bf16(weight, torch.eye(576), kernel)
    assert torch.equal(out, reference.bfloat16().float().T)


def test_the_kernel_rounds_x_to_nearest_even_as_torch(kernel):
    # W = I (Q4_1 blocks with d = 1, m = 0: weight k of row k is 1) picks x's columns: they
    # must be x rounded to bf16 as torch rounds, ties to even included.
    qs = torch.zeros(64, 32, dtype=torch.uint8)
    for k in range(64):
        block, position = divmod(k, 32)
        qs[k, block * 16 + position % 16] = 1 if position < 16 else 16
    scales = torch.zeros(64, 2, 2)
    scales[:, :, 0] = 1.0
    identity = QuantizedWeight("Q4_1", qs, scales)
    assert torch.equal(identity.dequantize(), torch.eye(64))
    ulp = 2.0**-7  # bf16's spacing at 1
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    x[0, :8] = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 1 + ulp / 2 + 2**-20,
                             3.0e38, -2.5e38, 1e-30, 65504.0])  # finite in bf16
    assert torch.equal(_bf16(identity, x, kernel), x.bfloat16().float())


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_other_rows(kernel, kind):
    # Each output is its own sum over k in a fixed order: the same bits whatever M is and
    # whichever rows come along (decode steps of any size give a request the same logits).
    weight, _ = random_quantized(kind, 64, 1536, seed=2)
    x = torch.randn(200, 1536, generator=torch.Generator().manual_seed(4))
    full = _bf16(weight, x, kernel)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 16), slice(3, 20), slice(64, 129),
                 slice(199, 200)):
        assert torch.equal(_bf16(weight, x[rows].contiguous(), kernel), full[rows])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_rows", [2, 17, 64, 65, 130])
def test_the_amx_kernel_reads_and_writes_bf16_as_it_does_float32(kernel, kind, num_rows):
    # A bf16 model's operators hand the AMX kernel bf16 x and take its sums in bf16: the
    # same values as float32 x (rounded in the kernel) and the float32 result (each sum
    # already rounded to bf16). 80 output rows: two panels at a time and one alone above
    # 64 rows. The other kernels read float32 only.
    weight, _ = random_quantized(kind, 80, 576, seed=num_rows)
    x = torch.randn(num_rows, 576, generator=torch.Generator().manual_seed(num_rows))
    if kernel != "amx":
        with pytest.raises(ValueError, match="contiguous float32"):
            _bf16(weight, x.bfloat16(), kernel)
        return
    out = _bf16(weight, x.bfloat16(), kernel)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, 80)
    assert torch.equal(out.float(), _bf16(weight, x, kernel))


@pytest.mark.parametrize("num_rows", [2, 16, 17, 64, 65, 130])
def test_a_nan_sum_is_torchs_nan_and_a_denormal_sum_is_zero(kernel, num_rows):
    # torch rounds every NaN to bf16 as 0x7fc0, and so do the kernels: the AMX kernel rounds
    # its sums by vcvtneps2bf16, which would keep a NaN's sign and payload, and masks them.
    # A sum of 2^-140 (a float32 denormal) comes back 0: tdpbf16ps and vdpbf16ps flush
    # denormal results (so vcvtneps2bf16's reading of denormals as zero never applies).
    # Row 0's x holds a negative NaN with a payload (in bf16 as the operator before hands
    # it to the AMX kernel; the others read float32); 48 output rows: a pair of panels and
    # one alone, each row count taking the AMX kernel's gather and transpose stores.
    weight, _ = random_quantized("Q8_0", 48, 64, seed=num_rows)
    x = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    x.view(torch.int16)[0, 5] = -0x3F  # 0xffc1: sign set, quiet, payload 1
    out = _bf16(weight, x if kernel == "amx" else x.float(), kernel)
    nan = out[0].view(torch.int16) if kernel == "amx" else out[0].view(torch.int32)
    assert (nan == (0x7FC0 if kernel == "amx" else 0x7FC00000)).all()
    assert not out[1:].isnan().any()
    blocks = np.zeros((48, 2, 34), dtype=np.uint8)  # Q8_0: float16 d, then 32 int8 q
    blocks[:, :, 0] = 1  # d = 2^-24, the least float16
    blocks[:, 0, 2] = 1  # q = 1 at k = 0: every row's first weight 2^-24, the rest 0
    tiny = QuantizedWeight.from_blocks("Q8_0", blocks.reshape(48, 68))
    x = torch.zeros(num_rows, 64)
    x[:, 0] = 2.0**-116  # times 2^-24: 2^-140
    out = _bf16(tiny, x.bfloat16() if kernel == "amx" else x, kernel)
    assert torch.equal(out.float(), torch.zeros(num_rows, 48))


def test_the_panel_kernels_refuse_shapes_off_their_panels(kernel):
    if kernel == "dp":
        pytest.skip("the vdpbf16ps kernel's dot-product form takes any number of output rows")
    weight, _ = random_quantized("Q8_0", 24, 64)  # 24 output rows: not whole 16-row panels
    with pytest.raises(ValueError, match="multiple of 16 output rows"):
        _bf16(weight, torch.randn(3, 64), kernel)
    # K off the 32-weight blocks: the C entry point's refusal code (the bindings never get
    # that far: a weight's width is whole blocks).
    entry = quant_linear.load()._kernels["Q8_0", kernel]
    y, x = torch.empty(1, 16), torch.randn(1, 48)
    qs, d = torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 2)
    assert entry(y.data_ptr(), x.data_ptr(), 1, 48, 16, qs.data_ptr(), d.data_ptr()) == 1


def test_the_vdpbf16ps_kernel_takes_any_number_of_output_rows(kernel):
    if kernel != "dp":
        pytest.skip("the panel kernels take whole 16-row panels")
    weight, reference = random_quantized("Q8_0", 24, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    exact = x.bfloat16().double() @ reference.bfloat16().double().T
    bound = _bound(x.bfloat16(), reference.bfloat16())
    assert _rounded_within(_bf16(weight, x, kernel), exact, bound)


def test_other_levels_have_neither_bf16_kernel(kernel):
    ops = quant_linear.load("avx2")
    assert ops is not None and not ops.amx and not ops.dp
    weight, _ = random_quantized("Q4_1", 16, 64)
    bound = ops.bind(weight.kind, weight.qs, weight.scales)
    with pytest.raises(RuntimeError, match="AMX quantized kernel is not available"):
        bound(torch.randn(2, 64), amx=True)
    with pytest.raises(RuntimeError, match="vdpbf16ps quantized kernel is not available"):
        bound(torch.randn(2, 64), dp=True)
    with pytest.raises(RuntimeError, match="vdpbf16ps quantized kernel is not available"):
        bound(torch.randn(2, 64), dp_panels=True)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bf16_weight_routes_by_rows(kernel, kind):
    # A bf16 model's weight on amx (amx_max_rows set): 1-4 rows on the float32 few-row
    # kernel (whatever max_rows says, as the fused layer), AMX_MIN_ROWS and up on AMX.
    # On avx512_bf16 (dp_max_rows set): every product up to the limit on vdpbf16ps, in its
    # dot-product form up to DP_FEW_ROWS rows and in its panel form above.
    from dataclasses import replace

    from tokenserve.model.layers.quantization.gguf import AMX_MIN_ROWS, DP_FEW_ROWS

    if kernel in ("dp", "dp_panels"):
        weight, _ = random_quantized(kind, 32, 64, seed=5)
        bf16 = replace(weight, dp_max_rows=40, max_rows=2)
        assert bf16.uses_dp and bf16.row_limit == 40 and bf16.takes(40) and not bf16.takes(41)
        for rows in (1, 3, DP_FEW_ROWS, DP_FEW_ROWS + 1, 40):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            form = "dp" if rows <= DP_FEW_ROWS else "dp_panels"
            assert torch.equal(bf16.matmul(x), _bf16(weight, x, form))
            assert not torch.equal(bf16.matmul(x), weight.matmul(x, panels=False))
        return

    weight, _ = random_quantized(kind, 32, 64, seed=5)
    bf16 = replace(weight, amx_max_rows=128, max_rows=2)
    assert bf16.uses_amx and bf16.row_limit == 128 and bf16.takes(128) and not bf16.takes(129)
    x = torch.randn(AMX_MIN_ROWS, 64, generator=torch.Generator().manual_seed(6))
    small = x[: AMX_MIN_ROWS - 1].contiguous()
    assert torch.equal(bf16.matmul(small), weight.matmul(small, panels=False))
    assert not torch.equal(bf16.matmul(small), _bf16(weight, small, kernel))
    assert torch.equal(bf16.matmul(x), _bf16(weight, x, kernel))
    # Off the 16-row panels the float32 kernels keep their routing.
    odd, _ = random_quantized(kind, 24, 64)
    assert not replace(odd, amx_max_rows=128).uses_amx
