"""Cascade attention (attention/cascade.py, in attention/torch_sdpa.py): prefill chunks that continue contexts
sharing their first blocks attend to the shared prefix in one call and to the rest of
their contexts apart, merged by log-sum-exp. Against the same step without it."""

from __future__ import annotations

import pytest
import torch

from tokenserve.attention import torch_sdpa
from tokenserve.attention.backend import CommonAttentionMetadata
from tokenserve.attention.torch_sdpa import TorchSDPABackend

BLOCK_SIZE = 16
PREFIX_BLOCKS = 66  # 1,056 tokens: over CASCADE_MIN_PREFIX_TOKENS


def _step(requests, heads=6, kv_heads=2, dim=64, cache_dtype=torch.float32, seed=0):
    """requests: (query_len, seq_len, block table) each. Returns the metadata's pieces and
    the step's query/key/value and caches (random)."""
    generator = torch.Generator().manual_seed(seed)
    query_start_loc = [0]
    slots = []
    for query_len, seq_len, table in requests:
        query_start_loc.append(query_start_loc[-1] + query_len)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in range(seq_len - query_len, seq_len)]
    num_tokens = query_start_loc[-1]
    num_blocks = 1 + max(max(table) for _, _, table in requests)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    query, key, value = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    tensors = (
        query.view(num_tokens, heads, dim),
        key.view(num_tokens, kv_heads, dim),
        value.view(num_tokens, kv_heads, dim),
    )
    shape = TorchSDPABackend().kv_cache_shape(num_blocks, BLOCK_SIZE, kv_heads, dim)
    kv_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    return query_start_loc, slots, tensors, kv_cache


def _run(backend, requests, query_start_loc, slots, tensors, kv_cache):
    metadata = backend.build_metadata(CommonAttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=query_start_loc,
        seq_lens=[seq_len for _, seq_len, _ in requests],
        block_tables=[table for _, _, table in requests], block_size=BLOCK_SIZE,
    ))
    output = backend.forward(*tensors, kv_cache.clone(), metadata, 0.125)
    return output, metadata


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cascade_matches_attention_chunk_by_chunk(use_kernels, cache_dtype):
    prefix = list(range(PREFIX_BLOCKS))
    prefix_len = PREFIX_BLOCKS * BLOCK_SIZE
    requests = [
        (1, 1200, [*prefix, *range(100, 110)]),  # a decode row
        (20, prefix_len + 20, [*prefix, 110, 111]),  # chunk: exactly the prefix cached
        (20, prefix_len + 20, [*prefix, 112, 113]),  # the same shape
        (7, prefix_len + 40, [*prefix, 114, 115, 116]),  # 33 more tokens cached past it
        (30, 30, [120, 121]),  # a first chunk: nothing cached, not in the cascade
        # Its own first blocks: a second cascade of two chunks, sharing 70 blocks, of which
        # the second chunk's queries start inside block 70 (so 70, not 71, are shared).
        (16, 71 * BLOCK_SIZE + 16, [*range(200, 271), 300, 301]),
        (9, 70 * BLOCK_SIZE + 12, [*range(200, 271)]),
        (5, 40, [400, 401, 402]),  # a continuing chunk that shares nothing
    ]
    pieces = _step(requests, cache_dtype=cache_dtype)
    # Prompt chunks in float32 whatever the cache: the two orders of summing agree to 1e-5.
    plain, plain_data = _run(
        TorchSDPABackend(use_kernels=use_kernels, cascade=False, native_bf16=False), requests,
        *pieces
    )
    cascaded, data = _run(TorchSDPABackend(use_kernels=use_kernels, native_bf16=False),
                          requests, *pieces)
    assert plain_data.cascades == []
    assert [(c.prefix_len, len(c.rows)) for c in data.cascades] == [
        (prefix_len, 20 + 20 + 7),
        (70 * BLOCK_SIZE, 16 + 9),
    ]
    # Left per chunk: the first chunk and the chunk that shares nothing.
    assert [(chunk.start, chunk.end) for chunk in data.prompt_chunks] == [(48, 78), (103, 108)]
    torch.testing.assert_close(cascaded, plain, rtol=1e-5, atol=1e-5)
    if cache_dtype == torch.bfloat16:
        # In bf16 (native bf16 CPUs), both round queries and probabilities to 8 bits, in
        # different blocks: they agree to bf16's rounding of outputs of size ~1.
        in_bf16, _ = _run(TorchSDPABackend(use_kernels=use_kernels, native_bf16=True),
                          requests, *pieces)
        torch.testing.assert_close(in_bf16, plain, rtol=2e-2, atol=1e-2)


def test_no_cascade_below_the_threshold_or_for_a_single_chunk():
    shared = torch_sdpa.CASCADE_MIN_PREFIX_TOKENS // BLOCK_SIZE - 1
    long = list(range(PREFIX_BLOCKS))
    requests = [
        # Two chunks sharing one block short of the threshold.
        (8, shared * BLOCK_SIZE + 8, [*range(600, 600 + shared), 100]),
        (8, shared * BLOCK_SIZE + 8, [*range(600, 600 + shared), 101]),
        # A long shared prefix, but one chunk on it.
        (8, PREFIX_BLOCKS * BLOCK_SIZE + 8, [*range(500, 500 + PREFIX_BLOCKS), 102]),
        # A long prefix that two chunks share, but one of them has its queries in it.
        (8, PREFIX_BLOCKS * BLOCK_SIZE + 8, [*long, 103]),
        (PREFIX_BLOCKS * BLOCK_SIZE, PREFIX_BLOCKS * BLOCK_SIZE + 8, [*long, 104]),
    ]
    pieces = _step(requests)
    plain, _ = _run(TorchSDPABackend(cascade=False), requests, *pieces)
    output, data = _run(TorchSDPABackend(), requests, *pieces)
    assert data.cascades == []
    assert torch.equal(output, plain)
