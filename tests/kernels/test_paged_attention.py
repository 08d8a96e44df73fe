"""The paged decode kernel (kernels/csrc/paged_attention.c) on the shapes its vector code
splits on, against attention written out in float64 torch, for every instruction-set level
the host has (conftest.py): head sizes it specialises (64, 128), ones it takes with the size
a variable (96; 192 and 256, done in slices), ones only the plain loop takes (40; on AVX-512
48, 80, 112 and 144 with a bfloat16 cache read in float32 arithmetic or an 8-bit float
cache), a bfloat16 cache read with the bf16 numerics of the dot-product path (head sizes 16
past a multiple of 32 end in a half instruction: 48, 80, 112, and 144 in slices of 128 and
16; blocks of an odd size, which it leaves to the float32 code), 8-bit float caches (E4M3,
E5M2: widened to float32 whatever the numerics asked), query-head groups that fill its
per-pass head counts unevenly (1, 3, 4, 5, 7), contexts on and off block edges, one row and
many; under each prefetch plan (paged_attention.DECODE_PREFETCH), which give the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenserve.kernels import cpu_isa, paged_attention


@pytest.fixture(scope="module")
def paged(cpu_isa_level) -> paged_attention.PagedAttentionOps:
    paged_ops = paged_attention.load()
    assert paged_ops is not None, "the C kernels did not build (see the warning in the log)"
    return paged_ops


def _reference(query, key_cache, value_cache, tables, seq_lens, scale, bf16_rounding=False):
    """softmax(q·kᵀ · scale)·v per row and query head, in float64, from the cache's values.
    With bf16_rounding, as the dot-product path rounds: the query rounded to bf16, and the
    softmax's unnormalised weights e^(s - max) rounded to bf16 before they weigh the values
    (their sum is not rounded)."""
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for row, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len)
        blocks, offsets = tables[row, positions // block_size], positions % block_size
        for head in range(query.shape[1]):
            kv_head = head // group
            k = key_cache[blocks, kv_head, offsets].double()  # [seq_len, dim]
            v = value_cache[blocks, kv_head, offsets].double()
            q = query[row, head]
            if bf16_rounding:
                q = q.to(torch.bfloat16)
            scores = k @ q.double() * scale
            weights = torch.exp(scores - scores.max())
            if bf16_rounding:
                out[row, head] = weights.float().to(torch.bfloat16).double() @ v / weights.sum()
            else:
                out[row, head] = weights @ v / weights.sum()
    return out


@pytest.mark.parametrize(("cache_dtype", "bf16_numerics"),
                         [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True),
                          (torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True),
                          (torch.float8_e5m2, False)],
                         ids=["float32", "bfloat16", "bfloat16-numerics", "fp8-e4m3",
                              "fp8-e4m3-numerics", "fp8-e5m2"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "seq_lens"),
    [
        (9, 3, 64, 16, [1, 15, 16, 17, 33, 100]),
        (5, 1, 64, 16, [7, 40]),
        (14, 2, 64, 16, [9, 130]),
        (2, 2, 128, 16, [31, 64]),
        (12, 3, 128, 8, [3, 77]),
        (6, 2, 96, 16, [5, 50]),
        (3, 1, 192, 16, [21]),
        (8, 2, 256, 32, [1, 70]),
        (4, 4, 40, 16, [12, 19]),
        (10, 2, 80, 16, [29]),
        (4, 2, 48, 16, [5, 33]),
        (6, 3, 112, 16, [18]),
        (2, 1, 144, 16, [9, 40]),
        (9, 3, 64, 15, [14, 15, 31, 47]),
        # One row's three kv heads: on two or more threads (not a multiple of them) each
        # context is split in two halves, merged by their log-sum-exps (DecodeSplit).
        (9, 3, 64, 16, [300]),
        (12, 3, 128, 8, [77]),
        # A head size only the plain loop takes (36) keeps no log-sum-exps: whole contexts.
        (6, 3, 36, 16, [300]),
    ],
    ids=["gqa3-d64", "gqa5-d64", "gqa7-d64", "mha-d128", "gqa4-d128-b8", "gqa3-d96",
         "gqa3-d192", "gqa4-d256-b32", "mha-d40", "gqa5-d80", "gqa2-d48", "gqa2-d112",
         "gqa2-d144", "gqa3-d64-b15", "gqa3-d64-split", "gqa4-d128-b8-split",
         "gqa2-d36-unsplit"],
)
def test_paged_decode_matches_float64_attention(
    paged, cpu_isa_level, num_heads, num_kv_heads, head_dim, block_size, seq_lens, cache_dtype,
    bf16_numerics,
):
    generator = torch.Generator().manual_seed(head_dim + num_heads)
    seq_lens = torch.tensor(seq_lens)
    max_blocks = int(-(-seq_lens.max() // block_size))
    num_blocks = len(seq_lens) * max_blocks + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    # Each row's blocks scattered through the cache; block 0 is never used.
    tables = 1 + torch.randperm(num_blocks - 1, generator=generator)[: len(seq_lens) * max_blocks]
    tables = tables.view(len(seq_lens), max_blocks).contiguous()
    # Scores of a few units, as trained models have: the softmax neither flat nor one-hot.
    query = 2 * torch.randn(len(seq_lens), num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    outs = {}
    for plan in paged_attention.DECODE_PREFETCH:
        outs[plan] = torch.full_like(query, float("nan"))
        paged.decode(outs[plan], query, torch.arange(len(seq_lens)), key_cache, value_cache,
                     tables, seq_lens, scale, bf16_numerics, prefetch=plan)
    out = outs["stream_next_item"]
    # Prefetches move no arithmetic.
    assert torch.equal(outs["own_tokens_ahead"], out)
    dot_products = paged.dot_products(cache_dtype, head_dim, block_size, bf16_numerics)
    assert dot_products == (cache_dtype == torch.bfloat16 and bf16_numerics
                            and cpu_isa.native_bf16(cpu_isa_level)
                            and head_dim % 16 == 0 and block_size % 2 == 0)
    expected = _reference(query, key_cache, value_cache, tables, seq_lens, scale,
                          bf16_rounding=dot_products)
    # float32 arithmetic on the cache's very values (and, on the dot-product path, on the
    # reference's bf16 roundings): only the order of the sums differs. A weight whose
    # float32 value lies within float32's error of a bf16 rounding boundary may round the
    # other way than in float64, moving an output by at most 2^-8 of that weight's share;
    # the seeded inputs here have none.
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(("cache_dtype", "bf16_numerics"),
                         [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True),
                          (torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True),
                          (torch.float8_e5m2, False)],
                         ids=["float32", "bfloat16", "bfloat16-numerics", "fp8-e4m3",
                              "fp8-e4m3-numerics", "fp8-e5m2"])
def test_paged_decode_row_alone_equals_row_among_many(paged, cache_dtype, bf16_numerics):
    """Without the split (as `--batch-invariant` runs it), a row's output is bit-identical
    whichever rows share the call and wherever its blocks lie in the cache; with it, a row
    alone may take its context in two halves (DecodeSplit), to within float32 rounding."""
    generator = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    seq_lens = torch.tensor([50, 3, 200, 16, 97])
    shape = (100, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    order = torch.randperm(100, generator=generator)
    tables, spare = order[:65].view(5, 13).contiguous(), order[65:]
    query = torch.randn(5, num_heads, head_dim, generator=generator)
    together = torch.empty_like(query)
    paged.decode(together, query, torch.arange(5), key_cache, value_cache, tables, seq_lens,
                 0.125, bf16_numerics, split=False)
    for row in range(5):
        # The row's blocks copied to unused ones: another block table, the same context.
        used = tables[row, : -(-int(seq_lens[row]) // block_size)]
        moved = spare[: len(used)]
        key_cache[moved], value_cache[moved] = key_cache[used], value_cache[used]
        alone, halves = torch.empty(1, num_heads, head_dim), torch.empty(1, num_heads, head_dim)
        for out, split in ((alone, False), (halves, True)):
            paged.decode(out, query[row : row + 1], torch.zeros(1, dtype=torch.int64),
                         key_cache, value_cache, moved.view(1, -1).contiguous(),
                         seq_lens[row : row + 1].contiguous(), 0.125, bf16_numerics, split=split)
        assert torch.equal(alone[0], together[row])
        torch.testing.assert_close(halves[0], together[row], rtol=1e-5, atol=2e-6)


def test_the_prefetch_plan_follows_the_cpu_vendor(monkeypatch: pytest.MonkeyPatch):
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
    amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
    assert cpu_isa.parse_vendor(intel) == "GenuineIntel"
    assert cpu_isa.parse_vendor(amd) == "AuthenticAMD"
    assert cpu_isa.parse_vendor("processor\t: 0\n") == ""
    assert paged_attention.decode_prefetch("GenuineIntel") == "own_tokens_ahead"
    assert paged_attention.decode_prefetch("AuthenticAMD") == "stream_next_item"
    assert paged_attention.decode_prefetch("") == "stream_next_item"  # e.g. not x86 Linux
    monkeypatch.setattr(cpu_isa, "cpu_vendor", lambda: "GenuineIntel")
    codes = paged_attention.DECODE_PREFETCH
    assert paged_attention.prefetch_code(None) == codes["own_tokens_ahead"]
    # A plan forced for the process (benchmarks) stands in for the CPU's, not for a named one.
    paged_attention.force_decode_prefetch("stream_next_item")
    try:
        assert paged_attention.prefetch_code(None) == codes["stream_next_item"]
        assert paged_attention.prefetch_code("own_tokens_ahead") == codes["own_tokens_ahead"]
    finally:
        paged_attention.force_decode_prefetch(None)
    assert paged_attention.prefetch_code(None) == codes["own_tokens_ahead"]
    for call in (lambda: paged_attention.prefetch_code("l3"),
                 lambda: paged_attention.force_decode_prefetch("l3")):
        with pytest.raises(ValueError, match="decode prefetch must be one of"):
            call()


def test_the_shared_prefix_is_the_blocks_most_rows_hold_first():
    def shared(tables, seq_lens, min_rows=2, min_positions=16):
        rows, positions = paged_attention.shared_prefix_rows(
            np.array(tables), seq_lens, 16, min_rows, min_positions)
        return rows.tolist(), positions

    tables = [[4, 5, 6, 9, 0], [4, 5, 6, 7, 8], [4, 5, 6, 7, 2]]
    # Three blocks of 16 in all three tables (3 x 48 row-positions); four in the last two
    # (2 x 64): the three rows.
    assert shared(tables, [70, 80, 75]) == ([0, 1, 2], 48)
    assert shared(tables, [70, 80, 75], min_rows=3) == ([0, 1, 2], 48)
    # Every row keeps its last position: at 48 positions the first row holds three blocks
    # of the prefix and nothing of its own, so it shares two.
    assert shared(tables, [48, 80, 75]) == ([0, 1, 2], 32)
    assert shared(tables[1:], [80, 75]) == ([0, 1], 64)
    # Rows with another first block are left out; the group of the most rows is taken.
    tables = [[9, 9, 9], [4, 5, 6], [4, 5, 7], [3, 5, 6], [4, 5, 6]]
    assert shared(tables, [40] * 5) == ([1, 2, 4], 32)
    assert shared(tables, [40] * 5, min_positions=48) == ([], 0)
    assert shared(tables, [40] * 5, min_rows=4) == ([], 0)
    # The reference row's blocks past its context are not its prefix.
    assert shared([[4, 5, 0], [4, 5, 0]], [20, 40]) == ([0, 1], 16)
    # No block in common, or too few rows.
    assert shared([[1, 2], [3, 2]], [30, 30]) == ([], 0)
    assert shared(np.zeros((0, 3), dtype=np.int64), []) == ([], 0)
