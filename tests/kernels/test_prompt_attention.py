"""The prompt-attention kernel (kernels/csrc/prompt_attention.c) against attention written
out in float64 torch, for every instruction-set level the host has (conftest.py): first
chunks and chunks continuing a cached context in one call, query lengths 1..300 (and the
default model's W1 and W4 steps), contexts
on and off block edges, head sizes the AMX path takes (64, 96, 128) and one only the
vdpbf16ps path takes (40), query-head groups 1, 3 and 4, float32 (the float32 path on
every level), bf16 and 8-bit float caches (E4M3, E5M2: on both bf16 paths widened to bf16
as key tiles are read, for head sizes of 32s; elsewhere the decode kernel per row); rows
outside the chunks untouched; a chunk's rows the same alone and among others; bad tables
refused."""

from __future__ import annotations

import pytest
import torch

from tokenserve.kernels import cpu_isa, prompt_attention
from tokenserve.kernels.paged_attention import DecodeRows
from tokenserve.kernels.prompt_attention import PromptChunks


@pytest.fixture(scope="module")
def kernel(cpu_isa_level) -> prompt_attention.PromptAttentionOps:
    ops = prompt_attention.load()
    assert ops is not None, "the C kernels did not build (see the warning in the log)"
    return ops


def _step(num_heads, num_kv_heads, head_dim, block_size, chunks, cache_dtype, seed=0, gap=2):
    """Chunks (query length, context length) laid out one after another with `gap` rows
    between them (decode rows of the step, not the kernel's), each context's blocks
    scattered through the cache (block 0 never used)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-seq_len // block_size) for _, seq_len in chunks]
    num_blocks = sum(blocks) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    order = (1 + torch.randperm(num_blocks - 1, generator=generator)).tolist()
    tables = torch.zeros(len(chunks), max(blocks), dtype=torch.int64)
    rows, start = [], 0
    for c, ((q_len, seq_len), n) in enumerate(zip(chunks, blocks)):
        tables[c, :n] = torch.tensor(order[:n])
        order = order[n:]
        rows.append([start, start + q_len, seq_len])
        start += q_len + gap
    # Scores of a few units, as trained models have: the softmax neither flat nor one-hot.
    query = 2 * torch.randn(start, num_heads, head_dim, generator=generator)
    return query, key_cache, value_cache, PromptChunks(torch.tensor(rows), tables)


def _reference(query, key_cache, value_cache, batch, scale, bf16_queries, bf16_until=None):
    """softmax(q·kᵀ · scale)·v per chunk and query head, causal aligned bottom-right, in
    float64 from the cache's values (and the queries rounded to bf16 where the kernel does:
    with bf16_until, for the scores of context positions before it only); rows outside the
    chunks NaN."""
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = query.shape[1] // num_kv_heads
    q = query.to(torch.bfloat16).double() if bf16_queries else query.double()
    rounded = query.to(torch.bfloat16).double()
    out = torch.full(query.shape, float("nan"), dtype=torch.float64)
    for (start, end, seq_len), table in zip(batch.chunks.tolist(), batch.block_tables):
        positions = torch.arange(seq_len)
        blocks, offsets = table[positions // block_size], positions % block_size
        k = key_cache[blocks, :, offsets].double()  # [seq_len, kv_heads, dim]
        v = value_cache[blocks, :, offsets].double()
        rows = torch.arange(seq_len - (end - start), seq_len)
        visible = positions[None, :] <= rows[:, None]
        for head in range(query.shape[1]):
            scores = q[start:end, head] @ k[:, head // group].T * scale
            if bf16_until is not None:
                before = rounded[start:end, head] @ k[:bf16_until, head // group].T * scale
                scores[:, :bf16_until] = before
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out[start:end, head] = weights @ v[:, head // group]
    return out


CASES = {
    # (heads, kv heads, head size, block size, [(query length, context length)])
    "gqa3-d64": (9, 3, 64, 16, [(37, 37), (3, 100), (100, 150), (1, 1), (2, 17)]),
    "gqa4-d128-long": (8, 2, 128, 16, [(300, 300), (40, 333)]),
    "mha-d64-b8": (6, 6, 64, 8, [(65, 200), (2, 5), (31, 31)]),
    "gqa4-d96-b32": (4, 1, 96, 32, [(45, 77), (64, 64)]),
    "mha-d40": (4, 4, 40, 16, [(17, 40), (33, 33), (1, 9)]),
    # The default model's step shapes: W1's 8 whole prompts (AMX items of whole chunks);
    # a W4 chunk over a long context beside short ones (its rows split over several items).
    "w1-gqa3-d64": (9, 3, 64, 16, [(256, 256)] * 8),
    "w4-gqa3-d64": (9, 3, 64, 16, [(256, 2048), (16, 528), (8, 8)]),
}


CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_prompt_attention_matches_float64_attention(kernel, cpu_isa_level, case, cache_dtype):
    num_heads, num_kv_heads, head_dim, block_size, chunks = CASES[case]
    query, key_cache, value_cache, batch = _step(num_heads, num_kv_heads, head_dim,
                                                 block_size, chunks, cache_dtype)
    native = kernel.native(cache_dtype, num_heads, num_kv_heads, head_dim)
    amx_shapes = cpu_isa_level == "amx" and head_dim % 32 == 0
    if cache_dtype.itemsize == 1:  # widened 32 elements at a time: head sizes of 32s
        assert native == (cpu_isa.native_bf16(cpu_isa_level) and head_dim % 32 == 0)
    else:
        assert native == (cache_dtype == torch.bfloat16 and cpu_isa.native_bf16(cpu_isa_level))
    amx = native and amx_shapes
    if cache_dtype == torch.float32:
        assert kernel.path(cache_dtype, num_heads, num_kv_heads, head_dim) == "float32"
    if native and not amx:
        assert kernel.path(cache_dtype, num_heads, num_kv_heads, head_dim) == "avx512_bf16"
    assert (kernel.path(cache_dtype, num_heads, num_kv_heads, head_dim) == "amx") == amx
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    kernel.attend(out, query, key_cache, value_cache, batch, scale)
    expected = _reference(query, key_cache, value_cache, batch, scale, bf16_queries=native)
    outside = expected.isnan()
    assert out[outside].isnan().all(), "rows outside the chunks were written"
    if native:
        # The queries are rounded to bf16 in the reference too; what is left is P rounded
        # to bf16 for P·V (relative 2^-9 per weight, so at most 2^-9 · max|v| on an output)
        # and float32 sums in another order: 2^-8 · max|v| bounds both.
        atol = 2**-8 * value_cache.float().abs().max().item()
        torch.testing.assert_close(out[~outside].double(), expected[~outside], rtol=0,
                                   atol=atol)
    else:
        # float32 arithmetic on the cache's very values: only the order of the sums differs.
        torch.testing.assert_close(out[~outside].double(), expected[~outside], rtol=1e-5,
                                   atol=2e-6)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_a_running_maximum_that_keeps_moving(kernel, cpu_isa_level, cache_dtype):
    """Scores that grow along the context (the running maximum moves a little at many key
    tiles: the bf16 paths, AMX and `vdpbf16ps`, and the float32 path then keep a stale
    maximum, with probabilities above 1) and jump at two keys (by far more: it moves), sharp
    enough that most weights underflow: still float64 attention within the bf16 bound (a
    float32 cache: within float32 sums)."""
    chunks = [(70, 400), (33, 33), (1, 260)]
    query, key_cache, value_cache, batch = _step(9, 3, 64, 16, chunks, cache_dtype)
    block_size = key_cache.shape[2]
    for (_, _, seq_len), table in zip(batch.chunks.tolist(), batch.block_tables):
        positions = torch.arange(seq_len)
        ramp = torch.linspace(0.2, 3.0, seq_len)
        ramp[seq_len // 3] = ramp[-3] = 8.0  # jumps, also in the masked diagonal tiles
        blocks, offsets = table[positions // block_size], positions % block_size
        key_cache[blocks, :, offsets] = (key_cache[blocks, :, offsets].float()
                                         * ramp[:, None, None]).to(cache_dtype)
    out = torch.full_like(query, float("nan"))
    kernel.attend(out, query, key_cache, value_cache, batch, 0.125)
    native = kernel.native(cache_dtype, 9, 3, 64)
    expected = _reference(query, key_cache, value_cache, batch, 0.125, bf16_queries=native)
    inside = ~expected.isnan()
    atol = 2**-8 * value_cache.float().abs().max().item() if native else 2e-5
    torch.testing.assert_close(out[inside].double(), expected[inside], rtol=0, atol=atol)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_a_score_past_float32s_exponent_range_moves_the_maximum(kernel, cpu_isa_level,
                                                                 cache_dtype):
    """One key mid-context 300 times longer than the rest: its scores pass the running
    maximum by far more than e^88 (float32's largest exponential) for the queries that
    point its way. The maximum must move there, else the exponentials overflow; float64
    attention within the bf16 bound."""
    chunks = [(70, 400), (1, 260)]
    query, key_cache, value_cache, batch = _step(9, 3, 64, 16, chunks, cache_dtype)
    block_size = key_cache.shape[2]
    for (_, _, seq_len), table in zip(batch.chunks.tolist(), batch.block_tables):
        far = seq_len // 2
        block, offset = table[far // block_size], far % block_size
        key_cache[block, :, offset] = (key_cache[block, :, offset].float() * 300).to(
            cache_dtype)
    out = torch.full_like(query, float("nan"))
    kernel.attend(out, query, key_cache, value_cache, batch, 0.125)
    native = kernel.native(cache_dtype, 9, 3, 64)
    expected = _reference(query, key_cache, value_cache, batch, 0.125, bf16_queries=native)
    inside = ~expected.isnan()
    assert out[inside].isfinite().all()
    atol = 2**-8 * value_cache.float().abs().max().item() if native else 2e-5
    torch.testing.assert_close(out[inside].double(), expected[inside], rtol=0, atol=atol)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_a_chunk_alone_equals_the_chunk_among_others(kernel, cache_dtype):
    """A chunk's rows are bit-identical whichever chunks share the call: work items never
    span chunks."""
    chunks = [(50, 90), (7, 7), (120, 400), (1, 30)]
    query, key_cache, value_cache, batch = _step(9, 3, 64, 16, chunks, cache_dtype, gap=0)
    together = torch.zeros_like(query)
    kernel.attend(together, query, key_cache, value_cache, batch, 0.125)
    for c in range(len(chunks)):
        start, end, _ = batch.chunks[c].tolist()
        alone = torch.zeros_like(query)
        single = PromptChunks(batch.chunks[c : c + 1].contiguous(),
                              batch.block_tables[c : c + 1].contiguous())
        kernel.attend(alone, query, key_cache, value_cache, single, 0.125)
        assert torch.equal(alone[start:end], together[start:end])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunks", [[(256, 2048)], [(192, 1500), (64, 64), (1, 40)]])
def test_the_output_does_not_depend_on_the_thread_count(kernel, chunks, cache_dtype):
    """Items are cut by the thread count (a chunk of more than one thread's share of the work
    into a multiple of it): the rows are bit-identical on 1, 2 and 3 threads."""
    query, key_cache, value_cache, batch = _step(9, 3, 64, 16, chunks, cache_dtype, gap=0)
    threads = torch.get_num_threads()
    outs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = torch.zeros_like(query)
            kernel.attend(out, query, key_cache, value_cache, batch, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _share_prefix(batch, members, prefix_blocks, first=0):
    """The tables of chunks `members` made to start with chunk `first`'s first prefix_blocks
    blocks (their own first blocks then unused), as prefix caching hands a common prefix
    out."""
    tables = batch.block_tables.clone()
    for c in members:
        tables[c, :prefix_blocks] = tables[first, :prefix_blocks]
    return PromptChunks(batch.chunks, tables)


# Chunks behind a 272-token prefix (17 blocks of 16: a key tile of 64 straddles its end)
# among chunks of their own: chunk 3 has its own context, chunk 4 shares only 128 tokens (too
# few to be grouped), chunks 5-6 share the prefix again; chunk 2 is a first chunk over all
# of its context (its rows start after the prefix), chunk 7 a single row.
SHARED_CHUNKS = [(20, 300), (33, 320), (64, 336), (40, 90), (9, 290), (5, 280), (64, 400),
                 (1, 273)]
SHARED_MEMBERS = {17: [1, 2, 5, 6, 7], 8: [4]}


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunks_behind_a_shared_prefix_match_float64_attention_and_themselves_apart(
        kernel, cpu_isa_level, threads, cache_dtype):
    """On the AMX path, consecutive chunks whose tables start with the same blocks are one
    item (the prefix's key tiles laid out once for all of them): the rows are float64
    attention within the bf16 bound, and bit-identical to the same chunks over copies of the
    prefix in blocks of their own (one item per chunk), on 1, 2 and 3 threads."""
    query, key_cache, value_cache, apart = _step(9, 3, 64, 16, SHARED_CHUNKS, cache_dtype)
    shared = apart
    for blocks, members in SHARED_MEMBERS.items():
        shared = _share_prefix(shared, members, blocks)
    # The copies: each chunk's own prefix blocks hold chunk 0's values.
    for blocks, members in SHARED_MEMBERS.items():
        for c in members:
            own, source = apart.block_tables[c, :blocks], apart.block_tables[0, :blocks]
            key_cache[own], value_cache[own] = key_cache[source], value_cache[source]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = torch.full_like(query, float("nan"))
        kernel.attend(together, query, key_cache, value_cache, shared, 0.125)
        separate = torch.full_like(query, float("nan"))
        kernel.attend(separate, query, key_cache, value_cache, apart, 0.125)
    finally:
        torch.set_num_threads(before)
    native = kernel.native(cache_dtype, 9, 3, 64)
    expected = _reference(query, key_cache, value_cache, shared, 0.125, bf16_queries=native)
    inside = ~expected.isnan()
    atol = 2**-8 * value_cache.float().abs().max().item() if native else 2e-5
    torch.testing.assert_close(together[inside].double(), expected[inside], rtol=0, atol=atol)
    assert together[~inside].isnan().all()
    assert torch.equal(together[inside], separate[inside])


def test_bad_chunk_tables_are_refused(kernel):
    query, key_cache, value_cache, batch = _step(9, 3, 64, 16, [(5, 20)], torch.bfloat16)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="context length"):
        PromptChunks(torch.tensor([[0, 5, 4]]), batch.block_tables)
    with pytest.raises(ValueError, match="shorter than its context"):
        kernel.attend(out, query, key_cache, value_cache,
                      PromptChunks(torch.tensor([[0, 5, 40]]), batch.block_tables), 0.125)
    with pytest.raises(ValueError, match="past the end of the cache"):
        kernel.attend(out, query, key_cache, value_cache,
                      PromptChunks(batch.chunks, batch.block_tables + 1000), 0.125)
    with pytest.raises(ValueError, match="past the step's tokens"):
        kernel.attend(out[:3], query[:3], key_cache, value_cache, batch, 0.125)


def _shared_prefix_rows(num_heads, num_kv_heads, head_dim, block_size, prefix, suffixes,
                        others=(), seed=0, cache_dtype=torch.bfloat16):
    """Decode rows whose contexts start with the same `prefix` positions (the same blocks,
    first in their tables) and go on with `suffixes[r]` positions of their own, then rows
    of `others[r]` positions all their own; rows 2.. of the queries (rows 0 and 1 not the
    kernel's)."""
    generator = torch.Generator().manual_seed(seed)
    shared = prefix // block_size
    own = [-(-suffix // block_size) for suffix in suffixes]
    own_only = [-(-length // block_size) for length in others]
    num_blocks = 1 + shared + sum(own) + sum(own_only) + 2
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    order = (1 + torch.randperm(num_blocks - 1, generator=generator)).tolist()
    num_rows = len(suffixes) + len(others)
    tables = torch.zeros(num_rows, max(shared + max(own), max(own_only, default=0)),
                         dtype=torch.int64)
    tables[: len(suffixes), :shared] = torch.tensor(order[:shared])
    order = order[shared:]
    for row, (start, n) in enumerate([(shared, n) for n in own] + [(0, n) for n in own_only]):
        tables[row, start : start + n] = torch.tensor(order[:n])
        order = order[n:]
    seq_lens = torch.tensor([prefix + suffix for suffix in suffixes] + list(others))
    query = 2 * torch.randn(num_rows + 2, num_heads, head_dim, generator=generator)
    rows = torch.arange(2, num_rows + 2)
    return query, key_cache, value_cache, DecodeRows(rows, tables, seq_lens, prefix,
                                                     len(suffixes))


PREFIX_CASES = {
    # (heads, kv heads, head size, block size, shared prefix, each sharing row's own
    # positions, rows that share nothing: their lengths)
    # A prefix ending inside a key tile of the AMX kernel (64 keys), rows of 1..100 more.
    "gqa3-d64-b16": (9, 3, 64, 16, 48, [1, 2, 17, 40, 5, 9, 100, 3, 16], []),
    "gqa4-d128-b128": (8, 2, 128, 128, 256, [1, 130, 7, 9, 12, 200, 1, 1], []),
    # 300 rows of 3 heads: more queries per kv head than one AMX item takes (768).
    "gqa3-d64-many": (9, 3, 64, 16, 32, [1 + row % 5 for row in range(300)], []),
    # Rows sharing the prefix, then rows of contexts all their own, shorter and longer.
    "gqa3-d64-some": (9, 3, 64, 16, 64, [3, 20, 1, 7, 64, 2, 9, 30], [5, 200, 64, 1]),
}


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", list(PREFIX_CASES))
def test_decode_rows_over_a_shared_prefix_match_float64_attention(kernel, cpu_isa_level, case,
                                                                   cache_dtype):
    """Decode rows sharing their first blocks attend to them together on the AMX path (each
    half of the context with its own softmax, merged by their log-sum-exps), the rows after
    them to their whole contexts, elsewhere all as the decode kernel does: float64
    attention within the bf16 bound either way, the rows outside untouched. An 8-bit float
    cache's prefix half has the prompt kernel's bf16 numerics, the rest the decode kernel's
    float32 ones."""
    num_heads, num_kv_heads, head_dim, block_size, prefix, suffixes, others = \
        PREFIX_CASES[case]
    query, key_cache, value_cache, decode_rows = _shared_prefix_rows(
        num_heads, num_kv_heads, head_dim, block_size, prefix, suffixes, others,
        cache_dtype=cache_dtype)
    shared = kernel.shared_prefix_path(cache_dtype, True, num_heads, num_kv_heads,
                                       head_dim, block_size)
    assert shared == (cpu_isa_level == "amx")
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    kernel.decode_shared_prefix(out, query, key_cache, value_cache, decode_rows, scale,
                                bf16_numerics=True)
    assert out[:2].isnan().all(), "rows outside the decode rows were written"
    chunks = PromptChunks(
        torch.tensor([[row, row + 1, seq_len] for row, seq_len in
                      zip(decode_rows.rows.tolist(), decode_rows.seq_lens.tolist())]),
        decode_rows.block_tables)
    if cache_dtype == torch.bfloat16:
        native = cpu_isa.native_bf16(cpu_isa_level)
        expected = _reference(query, key_cache, value_cache, chunks, scale, bf16_queries=native)
    else:  # the decode kernel's float32 arithmetic, the prompt kernel's on the prefix half
        native = shared
        expected = _reference(query, key_cache, value_cache, chunks, scale, bf16_queries=False,
                              bf16_until=prefix if shared else None)
        # Only rows that share the prefix take the prompt kernel's numerics for it.
        if shared and others:
            alone = _reference(query, key_cache, value_cache, chunks, scale, False)
            expected[2 + len(suffixes):] = alone[2 + len(suffixes):]
    # Each half's probabilities rounded to bf16 (relative 2^-9 per weight), the halves'
    # outputs merged as a convex combination, float32 sums: 2^-8 · max|v| bounds it, as for
    # the prompt kernel; the decode kernel's float32 path (no native bf16) is exact but for
    # the order of its sums.
    atol = 2**-8 * value_cache.float().abs().max().item() if native else 2e-5
    torch.testing.assert_close(out[2:].double(), expected[2:], rtol=0, atol=atol)


def test_a_shared_prefix_must_be_whole_blocks_within_every_context(kernel):
    query, key_cache, value_cache, decode_rows = _shared_prefix_rows(9, 3, 64, 16, 32, [1, 5],
                                                                     [200])
    out = torch.empty_like(query)
    for prefix in (20, 48):  # not a whole block; a row's whole context (32 + 1 < 48)
        bad = DecodeRows(decode_rows.rows, decode_rows.block_tables, decode_rows.seq_lens,
                         prefix, 2)
        with pytest.raises(ValueError, match="whole blocks"):
            kernel.decode_shared_prefix(out, query, key_cache, value_cache, bad, 0.125, True)
    with pytest.raises(ValueError, match="some of the rows"):
        DecodeRows(decode_rows.rows, decode_rows.block_tables, decode_rows.seq_lens, 32, 4)
