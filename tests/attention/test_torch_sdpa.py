"""The CPU attention backend (attention/torch_sdpa.py) on mixed steps: decode rows, first
prompt chunks, chunks continuing a cached context and running requests advancing by several
tokens at once, against attention computed directly from each request's whole context;
with and without the C kernels; and the KV cache it lays out and allocates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenserve.attention.backend import CommonAttentionMetadata
from tokenserve.attention.selector import get_attention_backend
from tokenserve.attention.torch_sdpa import (
    TorchSDPABackend,
    TorchSDPAMetadata,
    prompt_kernel_paths,
)
from tokenserve.kernels import build, cpu_isa, paged_attention

HEADS, KV_HEADS, DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 64, 16, 64
SCALE = 0.125


def _step(query_lens, seq_lens, tables, seed=4):
    """The common metadata of a step, its query/key/value (views into one fused QKV tensor,
    as the model passes them) and the full keys/values of every context (random; the new
    tokens' among them)."""
    generator = torch.Generator().manual_seed(seed)
    query_start_loc, slots = [0], []
    for n, seq_len, table in zip(query_lens, seq_lens, tables):
        query_start_loc.append(query_start_loc[-1] + n)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in range(seq_len - n, seq_len)]
    num_tokens = query_start_loc[-1]
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=generator)
    query, key, value = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    tensors = (query.view(num_tokens, HEADS, DIM), key.view(num_tokens, KV_HEADS, DIM),
               value.view(num_tokens, KV_HEADS, DIM))
    common = CommonAttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=tables, block_size=BLOCK_SIZE,
    )
    return common, tensors, generator


def _cache(backend, dtype, generator):
    shape = backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM)
    return torch.randn(shape, generator=generator).to(dtype)


def _reference(common, tensors, kv_cache):
    """Each request's queries over its whole context read back from the cache (after the
    step's writes), causally: plain SDPA per request. A first prompt chunk attends to its
    keys and values as computed (a bfloat16 cache rounds them), over an 8-bit float cache as
    the cache holds them."""
    query, key, value = tensors
    key_cache, value_cache = TorchSDPABackend.split_kv_cache(kv_cache)
    out = torch.empty_like(query)
    for i in range(common.num_reqs):
        start, end = common.query_start_loc[i : i + 2]
        seq_len, table = common.seq_lens[i], common.block_tables[i]
        positions = torch.arange(seq_len)
        blocks = torch.tensor(table)[positions // BLOCK_SIZE]
        k = key_cache[blocks, :, positions % BLOCK_SIZE].transpose(0, 1).float()
        v = value_cache[blocks, :, positions % BLOCK_SIZE].transpose(0, 1).float()
        if seq_len == end - start > 1 and key_cache.itemsize > 1:
            k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
        mask = positions[None, :] <= torch.arange(seq_len - (end - start), seq_len)[:, None]
        out[start:end] = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1), k, v, attn_mask=mask, scale=SCALE, enable_gqa=True
        ).transpose(0, 1)
    return out


# Request 0: decode at 40 tokens; 1: a 20-token first chunk; 2: decode at 1 token; 3: a
# 5-token chunk after 30 cached tokens; 4 and 5: running requests advancing by 3 and 2
# tokens (a multi-token step); 6: decode at a block's edge.
QUERY_LENS = [1, 20, 1, 5, 3, 2, 1]
SEQ_LENS = [40, 20, 1, 35, 50, 17, 32]
TABLES = [[3, 9, 4], [10, 11], [20], [30, 31, 32], [40, 41, 42, 43], [50, 51], [52, 53]]


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                         torch.float8_e5m2])
def test_mixed_step_equals_attention_over_whole_contexts(use_kernels, cache_dtype):
    common, tensors, generator = _step(QUERY_LENS, SEQ_LENS, TABLES)
    # Prompt chunks in float32 whatever the cache (the bf16 ones: the test below).
    backend = TorchSDPABackend(use_kernels=use_kernels, native_bf16=False)
    assert (backend.ops is not None) == use_kernels
    kv_cache = _cache(backend, cache_dtype, generator)
    metadata = backend.build_metadata(common)
    assert isinstance(metadata, TorchSDPAMetadata)
    # One query token: a decode row; more (a prompt chunk or a multi-token step): SDPA.
    assert metadata.decode_rows.tolist() == [0, 21, 32]
    assert [(c.start, c.end, c.context is None) for c in metadata.prompt_chunks] == [
        (1, 21, True), (22, 27, False), (27, 30, False), (30, 32, False)]
    assert (metadata.decode_batch is not None) == use_kernels
    assert (metadata.padded_decode is None) == use_kernels
    assert not metadata.is_decode_only
    output = backend.forward(*tensors, kv_cache, metadata, SCALE)
    expected = _reference(common, tensors, kv_cache)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_prompt_chunks_over_a_bfloat16_cache_attend_in_bfloat16_where_native():
    """With native bf16 the prompt chunks attend in bf16 (queries and probabilities rounded
    to bf16; the keys and values the cache holds): within bf16 rounding of the float32
    result. The decode rows round alike where the C decode kernel has its dot-product path
    (AVX512_BF16), and match the float32 result exactly elsewhere."""
    common, tensors, generator = _step(QUERY_LENS, SEQ_LENS, TABLES)
    backend = TorchSDPABackend(native_bf16=True)
    assert backend.prompt_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert backend.prompt_dtype(torch.float32, torch.float32) == torch.float32
    assert TorchSDPABackend(native_bf16=False).prompt_dtype(
        torch.float32, torch.bfloat16) == torch.float32
    # Over 8-bit floats too (each one a bf16 exactly): on the prompt kernel where a bf16
    # cache takes it (head size 64, a multiple of 32), else on SDPA.
    assert backend.prompt_dtype(torch.float32, torch.float8_e4m3fn) == torch.bfloat16
    fp8_cache = torch.empty(1, KV_HEADS, BLOCK_SIZE, DIM, dtype=torch.float8_e4m3fn)
    bf16_cache = torch.empty(1, KV_HEADS, BLOCK_SIZE, DIM, dtype=torch.bfloat16)
    assert backend.prompt_kernel_takes(HEADS, fp8_cache) == backend.prompt_kernel_takes(
        HEADS, bf16_cache)
    kv_cache = _cache(backend, torch.bfloat16, generator)
    metadata = backend.build_metadata(common)
    output = backend.forward(*tensors, kv_cache, metadata, SCALE)
    expected = _reference(common, tensors, kv_cache)
    decode = metadata.decode_rows
    assert backend.bf16_decode(torch.float32, torch.bfloat16)
    if backend.ops.dot_products(torch.bfloat16, DIM, BLOCK_SIZE, bf16_numerics=True):
        error = (output[decode] - expected[decode]).abs()
        assert 1e-5 < error.max() < 2e-2, error.max()
    else:
        torch.testing.assert_close(output[decode], expected[decode], rtol=1e-5, atol=1e-5)
    prompt = torch.cat([torch.arange(c.start, c.end) for c in metadata.prompt_chunks])
    error = (output[prompt] - expected[prompt]).abs()
    # Queries and probabilities rounded to 8 significant bits (relative 2^-9 each), over
    # outputs of size ~1: a few thousandths, far above float32's ~1e-7.
    assert 1e-5 < error.max() < 2e-2, error.max()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                         torch.float8_e5m2])
def test_kernels_and_pure_torch_agree_and_write_the_same_cache(cache_dtype):
    assert paged_attention.load() is not None, "the C kernels did not build (see the log)"
    common, tensors, generator = _step(QUERY_LENS, SEQ_LENS, TABLES)
    base = _cache(TorchSDPABackend(), cache_dtype, generator)
    outputs, caches = [], []
    for backend in (TorchSDPABackend(use_kernels=True), TorchSDPABackend(use_kernels=False)):
        kv_cache = base.clone()
        metadata = backend.build_metadata(common)
        outputs.append(backend.forward(*tensors, kv_cache, metadata, SCALE))
        caches.append(kv_cache)
    assert torch.equal(caches[0], caches[1])
    bf16_prompts = backend.prompt_dtype(torch.float32, cache_dtype) == torch.bfloat16
    prompt = torch.cat([torch.arange(c.start, c.end) for c in metadata.prompt_chunks])
    decode = metadata.decode_rows
    # Where prompt chunks attend in bf16, the kernel (kernels/prompt_attention.py) and SDPA
    # both round queries and probabilities to bf16, summing in other orders: they agree to
    # bf16's rounding of outputs of size ~1; everything else to float32's. Decode rows
    # attend in the prompt chunks' dtype on both paths (bf16_decode: the C kernel's
    # dot-product path, SDPA in bf16), so the same holds for them.
    tolerance = {"rtol": 2e-2, "atol": 1e-2} if bf16_prompts else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(outputs[0][prompt], outputs[1][prompt], **tolerance)
    torch.testing.assert_close(outputs[0][decode], outputs[1][decode], **tolerance)


def test_a_decode_only_step_is_marked_so():
    common, _, _ = _step([1, 1, 1], [40, 1, 17], [[3, 9, 4], [20], [50, 51]])
    metadata = TorchSDPABackend().build_metadata(common)
    assert metadata.is_decode_only and metadata.num_decode_rows == 3
    assert metadata.decode_batch.seq_lens.tolist() == [40, 1, 17]
    assert metadata.decode_batch.block_tables.tolist() == [[3, 9, 4], [20, 0, 0], [50, 51, 0]]


def test_the_backend_owns_the_cache_layout():
    backend = get_attention_backend(torch.device("cpu"), torch.float32)
    assert isinstance(backend, TorchSDPABackend)
    assert backend.kv_cache_shape(10, 16, 3, 64) == (2, 10, 3, 16, 64)
    caches = backend.allocate_kv_cache(
        num_layers=4, num_blocks=10, block_size=16, num_kv_heads=3, head_size=64,
        dtype=torch.bfloat16, device=torch.device("cpu"),
    )
    assert len(caches) == 4 and all(cache.shape == (2, 10, 3, 16, 64) for cache in caches)
    assert all(cache.dtype == torch.bfloat16 and not cache.any() for cache in caches)
    key_cache, value_cache = TorchSDPABackend.split_kv_cache(caches[0])
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_cache.data_ptr() != value_cache.data_ptr()
    # No kernels for a bfloat16 model's queries, nor when they are switched off.
    assert get_attention_backend(torch.device("cpu"), torch.bfloat16).ops is None
    assert get_attention_backend(torch.device("cpu"), torch.float32, use_c_kernels=False).ops is None
    with pytest.raises(ValueError, match="No attention backend"):
        get_attention_backend(torch.device("meta"), torch.float32)


def test_prompt_chunks_attend_in_bf16_only_for_a_bf16_model():
    """A float32 model with a bf16 cache (--kv-cache-dtype bfloat16) keeps float32 prompt
    attention on every CPU; a bf16 model's follows the CPU (bf16 where it is native)."""
    cpu = torch.device("cpu")
    float_model = get_attention_backend(cpu, torch.float32, weights_dtype=torch.float32)
    assert float_model.prompt_dtype(torch.float32, torch.bfloat16) == torch.float32
    bf16_model = get_attention_backend(cpu, torch.float32, weights_dtype=torch.bfloat16)
    native = cpu_isa.native_bf16(build.selected_isa())
    assert bf16_model.prompt_dtype(torch.float32, torch.bfloat16) == (
        torch.bfloat16 if native else torch.float32
    )
    assert bf16_model.prompt_dtype(torch.float32, torch.float32) == torch.float32


def test_chunks_on_a_shared_prefix_go_to_the_prompt_kernel_where_it_runs(monkeypatch):
    """Chunks continuing one cached 48-token prefix (three blocks every table shares) are a
    cascade for SDPA; where the prompt-attention kernel takes the step's bf16 chunks (its AMX
    path, or its vdpbf16ps path on a CPU without AMX), it takes these too and no cascade
    runs. Either way each row attends its whole context, within bf16 rounding."""
    query_lens, seq_lens = [5, 7, 3], [53, 55, 51]
    tables = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 3, 12]]
    common, tensors, generator = _step(query_lens, seq_lens, tables)
    backend = TorchSDPABackend(native_bf16=True, cascade_min_prefix_tokens=32)
    kv_cache = _cache(backend, torch.bfloat16, generator)
    calls = []
    attend = TorchSDPABackend._attend_cascade

    def counted(self, output, query, key_cache, value_cache, cascade, scale):
        calls.append(len(cascade.rows))
        return attend(self, output, query, key_cache, value_cache, cascade, scale)

    monkeypatch.setattr(TorchSDPABackend, "_attend_cascade", counted)
    metadata = backend.build_metadata(common)
    assert len(metadata.cascades) == 1  # planned for SDPA; the kernel path skips it
    kernel = backend._prompt_kernel(tensors[0], kv_cache[0])
    assert kernel == (backend.prompt_ops is not None and backend.prompt_ops.path(
        torch.bfloat16, HEADS, KV_HEADS, DIM) in prompt_kernel_paths())
    output = backend.forward(*tensors, kv_cache, metadata, SCALE)
    # Without the kernel, one cascade attends all the step's rows (three chunks, 15 rows).
    assert calls == ([] if kernel else [sum(query_lens)])
    expected = _reference(common, tensors, kv_cache)
    error = (output - expected).abs()
    assert error.max() < 2e-2, error.max()


def test_the_vdpbf16ps_prompt_path_is_taken_only_where_the_cpu_has_no_amx():
    """On an AMX CPU SDPA's GEMMs run on AMX tiles and beat the kernel's vdpbf16ps path (what
    a lower --cpu-isa selects there); on an AVX512_BF16 CPU without AMX the kernel wins. The
    float32 path is taken everywhere."""
    zen4 = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
    sapphire_rapids = zen4 | {"amx_bf16", "amx_tile"}
    assert prompt_kernel_paths(zen4) == ("amx", "avx512_bf16", "float32")
    assert prompt_kernel_paths(sapphire_rapids) == ("amx", "float32")


@pytest.mark.parametrize("cascade", [False, True])
def test_float32_chunks_go_to_the_prompt_kernel_on_every_level(monkeypatch, cascade):
    """Over a float32 cache the prompt-attention kernel's float32 path takes all of a step's
    chunks on every level the kernels build for (first chunks and chunks continuing a
    context alike, those sharing a cached prefix too: no cascade runs), and the fused layer
    stack is told so; without the kernels, SDPA and the cascade. Float32 attention either
    way."""
    query_lens, seq_lens = [20, 5, 7, 1], [20, 53, 55, 40]
    tables = [[4, 8], [1, 2, 3, 10], [1, 2, 3, 11], [5, 6, 7]]
    common, tensors, generator = _step(query_lens, seq_lens, tables)
    backend = TorchSDPABackend(native_bf16=False,
                               cascade_min_prefix_tokens=32 if cascade else 1024)
    kv_cache = _cache(backend, torch.float32, generator)
    kernel_calls, cascade_calls = [], []
    if backend.prompt_ops is not None:
        attend = backend.prompt_ops.attend
        monkeypatch.setattr(backend.prompt_ops, "attend",
                            lambda *args: kernel_calls.append(1) or attend(*args))
    cascaded = TorchSDPABackend._attend_cascade
    monkeypatch.setattr(TorchSDPABackend, "_attend_cascade",
                        lambda *args: cascade_calls.append(1) or cascaded(*args))
    metadata = backend.build_metadata(common)
    assert bool(metadata.cascades) == cascade
    built = backend.prompt_ops is not None
    if built:
        assert backend.prompt_ops.path(torch.float32, HEADS, KV_HEADS, DIM) == "float32"
    assert backend.prompt_kernel_takes(HEADS, kv_cache[0]) == built
    output = backend.forward(*tensors, kv_cache, metadata, SCALE)
    assert kernel_calls == ([1] if built else [])
    assert cascade_calls == ([1] if cascade and not built else [])
    torch.testing.assert_close(output, _reference(common, tensors, kv_cache), rtol=1e-4,
                               atol=1e-5)
