"""The C kernels against plain PyTorch: paged decode attention and K/V writes, RMSNorm (with
the fused residual add), SwiGLU and rotary embeddings; each built for every instruction set
the host has (conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenserve.kernels import layer_ops, paged_attention


@pytest.fixture(scope="module")
def ops(cpu_isa_level) -> layer_ops.LayerOps:
    # The kernels are the default CPU path: on a machine with a C compiler they must build.
    loaded = layer_ops.load()
    assert loaded is not None, "the C kernels did not build (see the warning in the log)"
    return loaded


@pytest.fixture(scope="module")
def paged(cpu_isa_level) -> paged_attention.PagedAttentionOps:
    paged_ops = paged_attention.load()
    assert paged_ops is not None, "the C kernels did not build (see the warning in the log)"
    return paged_ops


def _by_slot(cache: torch.Tensor) -> torch.Tensor:
    """A cache [blocks, kv_heads, block_size, dim] as [slots, kv_heads, dim] (a copy)."""
    return cache.transpose(1, 2).flatten(0, 1)


def _reference_decode(query, key_cache, value_cache, tables, seq_lens, scale):
    block_size = key_cache.shape[2]
    flat_k = _by_slot(key_cache)
    flat_v = _by_slot(value_cache)
    outs = []
    for row, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len)
        slots = tables[row, positions // block_size] * block_size + positions % block_size
        k = flat_k[slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, len, dim]
        v = flat_v[slots].transpose(0, 1).unsqueeze(0)
        q = query[row].unsqueeze(0).unsqueeze(2)  # [1, heads, 1, dim]
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        outs.append(out[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 128, 32), (16, 2, 64, 16), (8, 2, 32, 8),
     (6, 1, 80, 32)],
    # 3, 1, 4 and 8 query heads per kv head on the specialised head sizes, then the plain
    # loop.
    ids=["gqa3-d64", "mha-d128", "gqa4-d128-b32", "gqa8-d64", "gqa4-d32-generic",
         "mqa-d80-generic"],
)
def test_paged_decode_matches_sdpa(
    paged, num_heads, num_kv_heads, head_dim, block_size, cache_dtype
):
    generator = torch.Generator().manual_seed(0)
    num_blocks = 400
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    # Lengths on and around block edges, a single token, and long ones.
    seq_lens = torch.tensor(
        [1, block_size - 1, block_size, block_size + 1, 7, 8, 9, 5 * block_size + 3, 300]
    )
    max_blocks = int(-(-seq_lens.max() // block_size))
    # Blocks scattered through the cache, in no order, none shared.
    tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * max_blocks]
    tables = tables.view(len(seq_lens), max_blocks).contiguous()
    # The decode rows sit among other tokens of the step, as every other row of a fused
    # QKV tensor (a strided view); the kernel reads and writes only its rows.
    num_tokens = 2 * len(seq_lens) + 1
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    query.mul_(3)
    rows = torch.arange(1, num_tokens, 2)
    scale = head_dim**-0.5
    out = torch.full((num_tokens, num_heads, head_dim), float("nan"))
    paged.decode(out, query, rows, key_cache, value_cache, tables, seq_lens, scale)
    # The reference reads the cache's very values, widened to float32.
    expected = _reference_decode(
        query[rows], key_cache.float(), value_cache.float(), tables, seq_lens, scale
    )
    torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)
    assert out[0::2].isnan().all()  # rows that are not decode rows are left alone


def test_paged_decode_refuses_wrong_inputs(paged):
    cache = torch.zeros(4, 1, 16, 64)
    query = torch.zeros(1, 1, 64)
    rows, table, lens = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                         torch.ones(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="float32"):
        paged.decode(query.clone(), query.double(), rows, cache, cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        paged.decode(query.clone(), query, rows, cache, cache, table.int(), lens, 1.0)
    with pytest.raises(ValueError, match="disagree"):
        paged.decode(query.clone(), query, rows, cache, cache, table, torch.ones(2).long(), 1.0)


def test_write_kv_rounds_to_bfloat16_as_torch_does(paged):
    generator = torch.Generator().manual_seed(6)
    tokens, kv_heads, dim, block_size = 20, 2, 64, 8
    key = torch.randn(tokens, kv_heads, dim, generator=generator) * 100
    key[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.00390625])
    value = torch.randn(tokens, kv_heads, dim, generator=generator)
    slots = torch.randperm(4 * block_size, generator=generator)[:tokens]
    key_cache = torch.zeros(4, kv_heads, block_size, dim, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    paged.write_kv(key_cache, value_cache, key, value, slots)
    # Bit for bit what torch's conversion gives (a tie, 1 + 2^-8, rounds to even: 1.0);
    # a NaN stays a NaN (torch's bit pattern for it may differ).
    written = _by_slot(key_cache)[slots]
    assert written[0, 0, 2].isnan() and float(written[0, 0, 3]) == 1.0
    written[0, 0, 2] = key[0, 0, 2] = 0.0
    assert torch.equal(written.view(torch.int16), key.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(_by_slot(value_cache)[slots], value.to(torch.bfloat16))
    with pytest.raises(ValueError, match="KV caches, both the same"):
        paged.write_kv(key_cache.half(), value_cache.half(), key, value, slots)


def _float8_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 values that a conversion to `dtype` can get wrong: every finite value of the
    format, the midpoints between neighbours (ties: to the even one) and a hair either side of
    them, values past the largest finite one, ones below half the smallest subnormal, a NaN;
    negated too."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[~codes.isnan()].unique().sort().values.double()
    midpoints = (finite[1:] + finite[:-1]) / 2
    largest = float(finite[-1])
    edges = torch.tensor([largest * 1.01, largest * 100, 1e30, float("inf"), 1e-30,
                          float("nan")], dtype=torch.float64)
    values = torch.cat([finite, midpoints, midpoints * (1 + 1e-6), midpoints * (1 - 1e-6),
                        edges])
    return torch.cat([values, -values]).float()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_write_kv_rounds_to_float8_as_torch_does_saturating(paged, dtype):
    values = _float8_values(dtype)
    values = torch.cat([values, torch.zeros(-len(values) % 64)]).view(-1, 1, 64)
    tokens = values.shape[0]
    key_cache = torch.zeros(tokens, 1, 1, 64, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    paged.write_kv(key_cache, value_cache, values, -values, torch.arange(tokens))
    # Bit for bit torch's conversion of the values clamped to the largest finite one.
    largest = torch.finfo(dtype).max
    for cache, written in ((key_cache, values), (value_cache, -values)):
        expected = written.clamp(-largest, largest).to(dtype)
        assert torch.equal(cache[:, :, 0].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(paged_attention.round_to_cache(values, dtype).view(torch.uint8),
                       key_cache[:, :, 0].view(torch.uint8))
    assert key_cache.float().nan_to_num().abs().max() == largest


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_decode_reads_every_float8_value_exactly(paged, dtype):
    """A context of one position weighs its value by exactly 1: each decode row's output is
    its value row as the kernel widens it, to be every code's float32 value."""
    codes = torch.arange(256, dtype=torch.uint8)
    # The cache never holds a NaN or an infinity (writes saturate).
    codes = codes[codes.view(dtype).float().isfinite()]
    codes = torch.cat([codes, torch.zeros(-len(codes) % 64, dtype=torch.uint8)])
    rows = len(codes) // 64
    value_cache = codes.view(rows, 1, 1, 64).view(dtype)
    query = torch.randn(rows, 2, 64, generator=torch.Generator().manual_seed(3))
    out = torch.empty_like(query)
    paged.decode(out, query, torch.arange(rows), value_cache, value_cache,
                 torch.arange(rows).view(rows, 1), torch.ones(rows, dtype=torch.int64), 0.125)
    for head in range(2):
        assert torch.equal(out[:, head], value_cache[:, 0, 0].float())


def test_write_kv_from_fused_qkv_views(paged):
    generator = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, dim, block_size = 70, 9, 3, 64, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    _, key, value = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    key, value = key.view(tokens, kv_heads, dim), value.view(tokens, kv_heads, dim)
    slots = torch.randperm(10 * block_size, generator=generator)[:tokens]
    key_cache = torch.zeros(10, kv_heads, block_size, dim)
    value_cache = torch.zeros(10, kv_heads, block_size, dim)
    paged.write_kv(key_cache, value_cache, key, value, slots)
    # Token t, kv head h sits at [slot // block_size, h, slot % block_size].
    slot = int(slots[7])
    assert torch.equal(key_cache[slot // block_size, 2, slot % block_size], key[7, 2])
    assert torch.equal(_by_slot(key_cache)[slots], key)
    assert torch.equal(_by_slot(value_cache)[slots], value)
    untouched = torch.ones(10 * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (_by_slot(key_cache)[untouched] == 0).all()


def _reference_rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_rms_norm_with_and_without_residual(ops):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(37, 576, generator=generator) * 4
    weight = torch.randn(576, generator=generator)
    residual = torch.randn(37, 576, generator=generator)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), _reference_rms_norm(x, weight, 1e-5))

    expected_stream = residual + x
    stream = residual.clone()
    out = ops.rms_norm(x, weight, 1e-6, stream)
    torch.testing.assert_close(stream, expected_stream, rtol=0, atol=0)
    torch.testing.assert_close(out, _reference_rms_norm(expected_stream, weight, 1e-6))


def test_silu_and_mul_over_a_wide_range(ops):
    generator = torch.Generator().manual_seed(2)
    gate_up = torch.randn(19, 2 * 1539, generator=generator) * 30  # odd width: a scalar tail
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -87.5, -20.0, 0.0, 20.0, 88.5, 200.0])
    gate, up = gate_up.chunk(2, dim=-1)
    out = ops.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_rotary_in_place_on_fused_qkv_views(ops):
    generator = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim, max_position = 11, 9, 3, 64, 512
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    angles = torch.rand(max_position, dim // 2, generator=generator) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.randint(0, max_position, (tokens,), generator=generator)

    def rotate(x):
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        half = dim // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s

    expected_q, expected_k = rotate(q.clone()), rotate(k.clone())
    untouched = qkv[:, (heads + kv_heads) * dim :].clone()
    ops.rotary(q, k, positions, cos, sin)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], untouched)  # values stay as they were


# Widths below, at and past a vector of 8 or 16 lanes, and the logits' 49152.
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (5, 16), (4, 33), (2, 100), (64, 49152)])
def test_argmax_rows_answers_as_torch_max_indices(ops, rows, cols):
    generator = torch.Generator().manual_seed(rows * cols)
    random = torch.randn(rows, cols, generator=generator)
    # Few distinct values: equal maxima in several lanes, the first must win.
    ties = torch.randint(0, 3, (rows, cols), generator=generator).float()
    with_nans = ties.clone()
    with_nans[:, -1] = float("nan")  # a NaN ranks above everything, the first one wins
    with_nans[0, cols // 2] = float("nan")
    negative_infinity = torch.full((rows, cols), float("-inf"))
    for x in (random, ties, with_nans, negative_infinity):
        assert torch.equal(ops.argmax_rows(x), x.max(dim=-1).indices)
        # bf16 logits (a bf16 LM head's): rounding makes more ties, the first must still win.
        x = x.to(torch.bfloat16)
        assert torch.equal(ops.argmax_rows(x), x.max(dim=-1).indices)


def test_argmax_rows_refuses_what_it_cannot_read(ops):
    with pytest.raises(ValueError):
        ops.argmax_rows(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError):
        ops.argmax_rows(torch.zeros(4, 2).t())
    with pytest.raises(ValueError):
        ops.argmax_rows(torch.zeros(4))
    with pytest.raises(ValueError):
        ops.argmax_rows(torch.zeros(2, 0))
