"""Steps of few rows (decode rows, and prompt chunks where the prompt-attention kernel takes
them) as one C call per layer (model/fused_decode.py) against the operator-by-operator path:
the same operators in the same order, so identical results."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tokenserve import LLM, SamplingParams
from tokenserve.attention import torch_sdpa
from tokenserve.benchmarks.datasets import random_token_prompts
from tokenserve.config import KernelConfig
from tokenserve.kernels import build, paged_attention, quant_linear
from tokenserve.kernels.cpu_isa import cpu_flags
from tokenserve.model.fused_decode import FusedDecodeLayerStack


def _model(llm: LLM):
    (model,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner.model)
    return model


def _prompts_fuse(llm: LLM) -> bool:
    """Whether the model's prompt chunks take the prompt-attention kernel (bf16 attention on
    a CPU with native bf16, or over a float32 cache), and so its prompt steps of few rows are
    fused too."""
    attn = _model(llm).model.layers[0].self_attn.attn
    (cache_dtype,) = llm.llm_engine.collective_rpc(
        lambda worker: worker.model_runner.kv_caches[0].dtype)
    cache = torch.empty(1, attn.num_kv_heads, 16, attn.head_size, dtype=cache_dtype)
    return attn.backend.prompt_kernel_takes(attn.num_heads, cache)


def _generate(llm: LLM, fused: bool, num_prompts: int, seed: int = 3):
    """Greedy tokens and top-2 logprobs for prompts of different lengths; the fused path on
    or off."""
    _model(llm).model.layer_stack.enabled = fused
    prompts = [
        prompt[: 20 + 9 * index]
        for index, prompt in enumerate(random_token_prompts(num_prompts, 128, 49152, seed=seed))
    ]
    # Different lengths, so that requests finish one by one and steps shrink row by row.
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        [
            SamplingParams(temperature=0.0, max_tokens=8 + 2 * index, ignore_eos=True, logprobs=2)
            for index in range(num_prompts)
        ],
        use_tqdm=False,
    )
    return [
        (
            list(output.outputs[0].token_ids),
            [sorted((k, v.logprob) for k, v in step.items())
             for step in output.outputs[0].logprobs],
        )
        for output in outputs
    ]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8"])
def test_fused_layers_equal_operators_one_by_one(kv_cache_dtype, fused_calls):
    llm = LLM(kv_cache_memory="128MiB", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    assert _model(llm).model.layer_stack.max_rows == 192
    expected = _generate(llm, fused=False, num_prompts=5)
    assert fused_calls == []
    assert _generate(llm, fused=True, num_prompts=5) == expected
    # The five prompts' step (190 rows) too where the prompt kernel takes its chunks.
    prompt_steps = {190} if _prompts_fuse(llm) else set()
    assert fused_calls and set(fused_calls) - {1, 2, 3, 4, 5} == prompt_steps


def test_bf16_model_fuses_its_steps_with_the_same_results(fused_calls):
    # A bfloat16 model keeps the GGUF blocks for the products of steps of few rows
    # (bf16_quantized_max_rows): its decode steps are fused, on the same float32 operators
    # as one by one, and where its prompt chunks attend in bf16 on the prompt kernel, its
    # prompt step (the five prompts, 190 rows) too if the limit takes that many rows.
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", enable_prefix_caching=False)
    # The level's default limit: the AMX block kernel's where it runs (amx), the vdpbf16ps
    # kernel's where that runs (avx512_bf16), else the float32 kernels'.
    ops = quant_linear.load()
    kernel = "amx" if ops is not None and ops.amx else "dp" if ops is not None and ops.dp \
        else "float32"
    limit = KernelConfig().bf16_block_max_rows(kernel)
    assert _model(llm).model.layer_stack.max_rows == limit
    expected = _generate(llm, fused=False, num_prompts=5)
    assert _generate(llm, fused=True, num_prompts=5) == expected
    prompt_steps = {190} if _prompts_fuse(llm) and limit >= 190 else set()
    assert fused_calls and set(fused_calls) - {1, 2, 3, 4, 5} == prompt_steps


def test_a_fused_step_above_the_block_kernels_row_round_has_the_same_results(fused_calls):
    # With the bf16 row limit at 1024, the twelve prompts' step (834 rows) is fused: its
    # products take the block kernel in rounds of rows (on amx the down projection's, K =
    # 1536: 384, 384 and 66, as the operator-by-operator path's products take them), each
    # row's sums the same either way.
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", enable_prefix_caching=False,
              bf16_quantized_max_rows=1024)
    if not _prompts_fuse(llm):
        pytest.skip("prompt chunks attend in bf16 on the prompt kernel only on a CPU with "
                    "native bf16")
    assert _model(llm).model.layer_stack.max_rows == 1024
    expected = _generate(llm, fused=False, num_prompts=12)
    assert _generate(llm, fused=True, num_prompts=12) == expected
    assert 834 in fused_calls


@pytest.fixture
def restore_decode_prefetch():
    yield
    paged_attention.force_decode_prefetch(None)


def test_the_decode_prefetch_plans_give_the_same_results(fused_calls, restore_decode_prefetch):
    # How the decode attention's threads prefetch (paged_attention.decode_prefetch, chosen
    # by the CPU's vendor) moves no arithmetic: under either plan, fused or operator by
    # operator, the same tokens and logprobs.
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", enable_prefix_caching=False)
    results = []
    for plan in paged_attention.DECODE_PREFETCH:
        paged_attention.force_decode_prefetch(plan)
        results += [_generate(llm, fused=True, num_prompts=5),
                    _generate(llm, fused=False, num_prompts=5)]
    assert all(result == results[0] for result in results[1:])
    assert fused_calls


@pytest.fixture
def three_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(3)  # the C kernels' OpenMP pool too: torch's is the same runtime
    yield
    torch.set_num_threads(previous)


def test_fused_steps_equal_the_operators_on_an_odd_number_of_threads(three_threads,
                                                                     fused_calls):
    # Each layer's work is shared out over the process's OpenMP threads (the products'
    # panels, the attention items, the rows of the norms), however many there are: three
    # here, more than CI's two cores, on steps mixing prompt chunks and decode rows.
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", enable_prefix_caching=False,
              max_num_batched_tokens=48, block_size=16)
    expected = _generate(llm, fused=False, num_prompts=6)
    assert _generate(llm, fused=True, num_prompts=6) == expected
    assert fused_calls
    assert ctypes.CDLL("libgomp.so.1").omp_get_max_threads() == 3


@pytest.mark.parametrize(("cpu_isa", "prefix_caching"),
                         [("auto", False), ("auto", True), ("avx512_bf16", False)])
def test_steps_mixing_prompt_chunks_and_decode_rows_fuse_with_the_same_results(
        monkeypatch, cpu_isa, prefix_caching):
    # A budget of 48 tokens cuts the prompts into chunks, each continuing the context its
    # request already has in the cache, beside the decode rows of the requests before; with
    # prefix caching the second run of the same prompts starts from cached blocks. The
    # avx512_bf16 level's prompt kernel (vdpbf16ps) is what a CPU without AMX takes: forced
    # here, on an AMX host too.
    if cpu_isa != "auto" and "avx512_bf16" not in cpu_flags():
        pytest.skip("the CPU has no AVX512_BF16")
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", max_num_batched_tokens=48,
              enable_prefix_caching=prefix_caching, block_size=16, cpu_isa=cpu_isa)
    if cpu_isa != "auto":
        # The prompt kernel's paths on a CPU without AMX (prompt_kernel_paths).
        _model(llm).model.layers[0].self_attn.attn.backend.prompt_paths = (
            "amx", "avx512_bf16")
    if not _prompts_fuse(llm):
        pytest.skip("prompt chunks attend in bf16 on the prompt kernel only on a CPU with "
                    "native bf16")
    taken: list[tuple[int, int]] = []
    original = FusedDecodeLayerStack.takes

    def recording(self, num_tokens, metadata, kv_caches):
        takes = original(self, num_tokens, metadata, kv_caches)
        if takes:
            taken.append((num_tokens - metadata.num_decode_rows, metadata.num_decode_rows))
        return takes

    monkeypatch.setattr(FusedDecodeLayerStack, "takes", recording)

    def twice(fused: bool):
        assert llm.llm_engine.reset_prefix_cache()
        return [_generate(llm, fused=fused, num_prompts=6, seed=4) for _ in range(2)]

    expected = twice(fused=False)
    assert taken == []
    assert twice(fused=True) == expected
    # Steps with prompt rows and decode rows both, and prompt-only ones, were fused.
    assert any(prompt and decode for prompt, decode in taken)
    assert any(prompt and not decode for prompt, decode in taken)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_a_stack_of_any_number_of_layers_fuses_with_the_same_results(num_layers, fused_calls):
    # The C call hands the layers' outputs between two buffers by turns: an odd number of
    # layers (a pipeline stage's share) ends in the other one than the model's 30.
    llm = LLM(kv_cache_memory="128MiB", enable_prefix_caching=False)
    model = _model(llm).model
    model.layer_stack = FusedDecodeLayerStack(
        torch.nn.ModuleList(list(model.layers)[:num_layers]), KernelConfig())
    expected = _generate(llm, fused=False, num_prompts=3)
    assert _generate(llm, fused=True, num_prompts=3) == expected
    assert fused_calls


def test_avx2_forced_on_a_better_cpu_fuses_with_the_same_results(fused_calls):
    # The AVX2 build of every kernel (kernels/cpu_isa.py), on a host that may have more.
    llm = LLM(dtype="float32", cpu_isa="avx2", kv_cache_memory="128MiB",
              enable_prefix_caching=False)
    (selected,) = llm.llm_engine.collective_rpc(lambda worker: build.selected_isa())
    assert selected == "avx2"
    expected = _generate(llm, fused=False, num_prompts=3)
    assert _generate(llm, fused=True, num_prompts=3) == expected
    assert fused_calls


def test_fused_layers_add_a_qkv_bias_pick_each_kernel_and_leave_large_steps_alone(fused_calls):
    # Dense float32 weights for the prompts' products: oneDNN's packed forms were made
    # without the bias added below.
    llm = LLM(kv_cache_memory="128MiB", enable_prefix_caching=False, disable_onednn=True)
    model = _model(llm).model
    generator = torch.Generator().manual_seed(0)
    for layer in model.layers:
        qkv_proj = layer.self_attn.qkv_proj
        qkv_proj.bias = torch.nn.Parameter(
            0.1 * torch.randn(qkv_proj.weight.shape[0], generator=generator), requires_grad=False
        )
        # Row limits low enough for 12 requests to step through all three regimes: 1-4 rows
        # on the few-row kernel, 5-8 on the many-row one, 9-12 not fused.
        for linear in (qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            linear.blocks.max_rows, linear.blocks.gemm_max_rows = 4, 8
    model.layer_stack = FusedDecodeLayerStack(model.layers, KernelConfig())
    assert model.layer_stack.max_rows == 8
    expected = _generate(llm, fused=False, num_prompts=12)
    assert _generate(llm, fused=True, num_prompts=12) == expected
    assert set(fused_calls) & {1, 2, 3, 4} and set(fused_calls) & {5, 6, 7, 8}
    assert max(fused_calls) <= 8


def test_the_settings_turn_the_fused_path_off(tiny_model_dirs):
    default = _model(LLM(kv_cache_memory="64MiB")).model.layer_stack
    off = _model(LLM(kv_cache_memory="64MiB", disable_fused_decode=True)).model.layer_stack
    assert default.enabled and default.max_rows == 192
    assert not off.enabled and off.ops is None
    # A model without GGUF blocks (a Hugging Face checkpoint) has nothing to fuse.
    hf_model = _model(LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB"))
    assert hf_model.model.layer_stack.max_rows == 0


def _generate_behind(llm: LLM, shared: list[int], prompts: list[list[int]], fused: bool,
                     max_tokens: int):
    """Greedy tokens and top-2 logprobs of prompts that start with `shared`, after a first
    request alone has put the prefix in the cache; the fused path on or off."""
    _model(llm).model.layer_stack.enabled = fused
    assert llm.llm_engine.reset_prefix_cache()
    first = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": shared + [7]}], first, use_tqdm=False)
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
        use_tqdm=False)
    return [(list(output.outputs[0].token_ids),
             [sorted((k, v.logprob) for k, v in step.items())
              for step in output.outputs[0].logprobs]) for output in outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_decode_rows_over_a_shared_prefix_fuse_with_the_same_results(monkeypatch, fused_calls,
                                                                     kv_cache_dtype):
    # Ten requests behind one 272-token prefix (17 blocks of 16, cached by a first request
    # alone) and three without it: the ten's decode rows share those blocks, which the
    # fused layer, and the operators one by one, attend to for those rows at once on the
    # AMX path (DecodeRows.prefix_len and prefix_rows; elsewhere each row alone), the three
    # to their whole contexts; over a bf16 cache and an 8-bit float one. Fused or not, the
    # same results.
    prefixes: list[tuple[int, int]] = []  # (rows, positions) of each shared prefix found
    original = torch_sdpa.shared_prefix_rows

    def recording(*args):
        rows, positions = original(*args)
        prefixes.append((len(rows), positions))
        return rows, positions

    monkeypatch.setattr(torch_sdpa, "shared_prefix_rows", recording)
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", enable_prefix_caching=True,
              block_size=16, kv_cache_dtype=kv_cache_dtype)
    shared, *rest = random_token_prompts(14, 272, 49152, seed=5)
    prompts = [shared + tail[:8 + index] for index, tail in enumerate(rest[:10])]
    prompts += [tail[: 40 + 100 * index] for index, tail in enumerate(rest[10:])]

    expected = _generate_behind(llm, shared, prompts, fused=False, max_tokens=6)
    assert (10, 272) in prefixes, "the decode rows' shared prefix was not found"
    prefixes.clear()
    assert _generate_behind(llm, shared, prompts, fused=True, max_tokens=6) == expected
    assert (10, 272) in prefixes and 13 in fused_calls


def test_prompt_chunks_and_decode_rows_behind_one_prefix_fuse_with_the_same_results(
        monkeypatch, fused_calls):
    # Twenty requests behind one 272-token prefix (cached by a first request alone), admitted
    # a few per step by a budget of 64 tokens: steps hold the decode rows of those before,
    # sharing the prefix (attended to together on the AMX path), beside the prompt chunks of
    # the next ones, which the AMX prompt kernel takes as one item per run of chunks behind
    # the prefix, each run needing more of the thread's kept AMX scratch than the decode rows'
    # prefix items. Fused or not, the same results.
    mixed: list[int] = []  # prompt chunks of each fused step that had both
    original = FusedDecodeLayerStack.takes

    def recording(self, num_tokens, metadata, kv_caches):
        takes = original(self, num_tokens, metadata, kv_caches)
        decode, chunks = metadata.decode_batch, metadata.prompt_batch
        if takes and decode is not None and decode.prefix_len >= 256 and chunks is not None:
            tables = chunks.block_tables[:, :17]
            mixed.append(int((tables == tables[0]).all(dim=1).sum()))
        return takes

    monkeypatch.setattr(FusedDecodeLayerStack, "takes", recording)
    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", enable_prefix_caching=True,
              block_size=16, max_num_batched_tokens=64)
    if not _prompts_fuse(llm):
        pytest.skip("prompt chunks attend in bf16 on the prompt kernel only on a CPU with "
                    "native bf16")
    shared, *rest = random_token_prompts(21, 272, 49152, seed=6)
    prompts = [shared + tail[:8 + index % 5] for index, tail in enumerate(rest)]

    expected = _generate_behind(llm, shared, prompts, fused=False, max_tokens=12)
    assert mixed == []
    assert _generate_behind(llm, shared, prompts, fused=True, max_tokens=12) == expected
    # Fused steps with decode rows over the prefix and two or more chunks behind it.
    assert any(count >= 2 for count in mixed), mixed


def test_a_lone_decode_row_splits_its_context_alike_fused_and_one_by_one(fused_calls):
    # One request: a decode step's attention is its row's three kv heads, too few to share
    # out evenly over CI's two cores, so the decode kernel takes each context in two halves
    # merged by their log-sum-exps (csrc/paged_attention.c, DecodeSplit), in the fused layer
    # and in the operators' kernel alike; without the split, the same tokens.
    llm = LLM(kv_cache_memory="128MiB", enable_prefix_caching=False, block_size=16)
    (backend,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner.attention)
    assert backend is _model(llm).model.layers[0].self_attn.attn.backend
    prompt = random_token_prompts(1, 90, 49152, seed=5)[0]

    def generate(fused: bool, split: bool):
        _model(llm).model.layer_stack.enabled = fused
        backend.split_decode = split
        (output,) = llm.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                logprobs=2), use_tqdm=False)
        return (list(output.outputs[0].token_ids),
                [sorted((k, v.logprob) for k, v in step.items())
                 for step in output.outputs[0].logprobs])

    fused = generate(fused=True, split=True)
    assert 1 in fused_calls
    assert generate(fused=False, split=True) == fused
    whole_contexts = generate(fused=True, split=False)
    assert whole_contexts[0] == fused[0]
    for step, expected in zip(whole_contexts[1], fused[1], strict=True):
        assert [k for k, _ in step] == [k for k, _ in expected]
        assert [v for _, v in step] == pytest.approx([v for _, v in expected], abs=1e-4)
