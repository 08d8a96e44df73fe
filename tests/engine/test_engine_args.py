"""Engine arguments: validation at the edge and the settings they resolve to."""

from __future__ import annotations

import pytest
import torch

from tokenserve import LLM, SamplingParams
from tokenserve.engine.engine_args import EngineArgs, parse_memory


def test_memory_sizes_parse():
    assert parse_memory("4GiB") == 4 * 1024**3
    assert parse_memory("512MiB") == 512 * 1024**2
    assert parse_memory(1000) == 1000
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory("lots")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="float64"), "dtype"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(scheduling_policy="lifo"), "scheduling_policy"),
        (dict(prefill_order="longest"), "prefill_order must be 'shortest' or 'arrival'"),
        (dict(oldest_prompt_share=1.5), "oldest_prompt_share must be between 0 and 1"),
        (dict(oldest_prompt_share=-0.1), "oldest_prompt_share"),
        (dict(oldest_prompt_share="half"), "oldest_prompt_share"),
        (dict(max_model_len=4096), "exceeds what the model supports"),
        # 4 blocks of 16 tokens cannot hold a 1000-token sequence: refused at start.
        (dict(num_kv_blocks=4, max_model_len=1000), "does not fit in the KV cache"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "chunked prefill"),
        (dict(target_step_ms=0), "target_step_ms"),
        (dict(admission_lookahead_tokens=-1), "admission_lookahead_tokens"),
        (dict(target_step_ms=-5.0), "target_step_ms"),
        (dict(target_step_ms=float("nan")), "target_step_ms"),
        (dict(target_step_ms="50"), "target_step_ms"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
        (dict(long_prefill_token_threshold=1.5), "long_prefill_token_threshold"),
        (dict(long_prefill_token_threshold=True), "long_prefill_token_threshold"),
        (dict(long_prefill_token_threshold=64, enable_chunked_prefill=False), "chunked prefill"),
        (dict(long_prefill_token_threshold=4096, max_model_len=1024), "more than max_model_len"),
    ],
)
def test_bad_settings_are_refused(tiny_model_dirs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_model_dirs["llama"], **kwargs).create_engine_config()


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--target-step-ms", "50"],
        ["bench", "throughput", "--target-step-ms", "50"],
        ["generate", "--prompt", "x", "--target-step-ms", "50"],
    ],
)
def test_target_step_ms_flag_reaches_the_scheduler_config(tiny_model_dirs, argv):
    from tokenserve.engine.cli_args import engine_args_from
    from tokenserve.entrypoints.cli import build_parser

    engine_args = engine_args_from(build_parser().parse_args(argv))
    engine_args.model = tiny_model_dirs["llama"]
    assert engine_args.create_engine_config().scheduler_config.target_step_ms == 50.0
    engine_args.target_step_ms = None  # the default: no target
    assert engine_args.create_engine_config().scheduler_config.target_step_ms is None


def test_prefill_order_flag_reaches_the_scheduler_config(tiny_model_dirs):
    from tokenserve.engine.cli_args import engine_args_from
    from tokenserve.entrypoints.cli import build_parser

    parser = build_parser()
    for argv, expected in (
        (["serve"], "shortest"),  # the default
        (["serve", "--prefill-order", "arrival"], "arrival"),
        (["bench", "throughput", "--prefill-order", "arrival"], "arrival"),
    ):
        engine_args = engine_args_from(parser.parse_args(argv))
        engine_args.model = tiny_model_dirs["llama"]
        assert engine_args.create_engine_config().scheduler_config.prefill_order == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefill-order", "longest"])


@pytest.mark.parametrize(
    "flag, field, default, values",
    [
        ("--admission-lookahead-tokens", "admission_lookahead_tokens", 256, (0, 64)),
        ("--long-prefill-token-threshold", "long_prefill_token_threshold", 0, (128, 64)),
        ("--oldest-prompt-share", "oldest_prompt_share", 0.5, (0.25, 0.0)),
    ],
)
def test_scheduler_flags_reach_the_scheduler_config(
    tiny_model_dirs, flag, field, default, values
):
    from tokenserve.engine.cli_args import engine_args_from
    from tokenserve.entrypoints.cli import build_parser

    parser = build_parser()
    for argv, expected in (
        (["serve"], default),
        (["serve", flag, str(values[0])], values[0]),
        (["bench", "throughput", flag, str(values[1])], values[1]),
    ):
        engine_args = engine_args_from(parser.parse_args(argv))
        engine_args.model = tiny_model_dirs["llama"]
        config = engine_args.create_engine_config().scheduler_config
        assert getattr(config, field) == expected


@pytest.mark.parametrize(
    "kwargs, budget",
    [
        (dict(dtype="float32"), 1024),
        (dict(dtype="bfloat16"), 2048),
        (dict(dtype="float16"), 2048),
        (dict(dtype="float32", max_num_batched_tokens=300), 300),
        # Without chunked prefill a whole prompt fits one step: at least max_model_len.
        (dict(dtype="float32", enable_chunked_prefill=False, max_model_len=512), 1024),
        (dict(dtype="float32", enable_chunked_prefill=False, max_model_len=1536), 1536),
    ],
)
def test_default_token_budget_follows_the_dtype(tiny_model_dirs, kwargs, budget):
    args = EngineArgs(model=tiny_model_dirs["llama"], num_kv_blocks=128, block_size=16, **kwargs)
    assert args.create_engine_config().scheduler_config.max_num_batched_tokens == budget


def test_unknown_engine_argument_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match="Unknown engine argument"):
        LLM(tiny_model_dirs["llama"], max_num_seq=4)


def test_kv_cache_sized_from_memory_budget(tiny_model_dirs):
    config = EngineArgs(model=tiny_model_dirs["llama"], kv_cache_memory="1MiB").create_engine_config()
    # 2 layers x (K + V) x 2 kv heads x 16 head dim x 4 bytes = 512 bytes per token.
    assert config.model_config.kv_bytes_per_token() == 512
    assert config.cache_config.block_size == 128  # the CPU default, as vLLM's
    assert config.cache_config.num_blocks == 1024**2 // (512 * 128)
    # The model allows 2048 positions but the cache holds only 2048 tokens: it fits exactly.
    assert config.model_config.max_model_len == 2048


def test_bfloat16_kv_cache_holds_twice_the_tokens_and_rounds_what_it_reads(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    full = EngineArgs(model=model, kv_cache_memory="1MiB").create_engine_config()
    narrow = EngineArgs(
        model=model, kv_cache_memory="1MiB", kv_cache_dtype="bfloat16"
    ).create_engine_config()
    assert (full.cache_config.dtype, narrow.cache_config.dtype) == ("float32", "bfloat16")
    assert narrow.cache_config.num_blocks == 2 * full.cache_config.num_blocks
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model=model, kv_cache_dtype="int8").create_engine_config()

    # A 64-token prompt prefilled 16 tokens a step: the first chunk attends to the keys and
    # values it computed (the same logprobs as with a float32 cache); later chunks read
    # the earlier ones back from the cache, rounded (close, not the same). Both on SDPA:
    # a float32 cache's chunks would take the prompt kernel's float32 path (its own order
    # of sums), a float32 model's over a bf16 cache keep SDPA.
    prompt = list(range(10, 74))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    logprobs = []
    for kv_cache_dtype in ("auto", "bfloat16"):
        llm = LLM(model, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16,
                  kv_cache_memory="8MiB")
        (runner,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
        assert runner.kv_caches[0][0].dtype == (
            torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32
        )
        runner.attention.prompt_paths = ()  # the backend every layer attends with
        [output] = llm.generate([prompt], params, use_tqdm=False)
        logprobs.append(torch.tensor([
            output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))
        ]))
    assert torch.equal(logprobs[0][:16], logprobs[1][:16])
    difference = (logprobs[0][16:] - logprobs[1][16:]).abs()
    assert 0 < difference.max() < 0.25 and difference.mean() < 0.05, difference


def test_an_fp8_kv_cache_holds_four_times_float32s_tokens_and_stays_close(default_model_path):
    """vLLM's --kv-cache-dtype fp8 (E4M3) and fp8_e5m2: one byte an element. On the default
    model, a prompt prefilled 16 tokens a step reads its earlier chunks back from the cache:
    teacher-forced logprobs close to those over the model's own cache dtype, not equal (the
    cache is read)."""
    # Ten float32 blocks of 128 tokens (30 layers, 3 kv heads of 64, keys and values).
    args = {"model": default_model_path, "kv_cache_memory": 10 * 128 * 30 * 2 * 3 * 64 * 4}
    full = EngineArgs(**args, dtype="float32").create_engine_config()
    assert full.cache_config.num_blocks == 10
    for name, stored in (("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"),
                         ("fp8_e5m2", "float8_e5m2")):
        narrow = EngineArgs(**args, dtype="float32", kv_cache_dtype=name).create_engine_config()
        assert narrow.cache_config.dtype == stored
        assert narrow.cache_config.num_blocks == 4 * full.cache_config.num_blocks

    text = ("The history of the Roman Empire spans more than a thousand years, from the "
            "founding of the city to the fall of Constantinople. Its institutions, laws and "
            "languages shaped Europe. Write a short summary of the main periods.")
    logprobs = {}
    for name in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(default_model_path, kv_cache_dtype=name, max_num_batched_tokens=16,
                  kv_cache_memory="64MiB", enable_prefix_caching=False)
        prompt = llm.get_tokenizer().encode(text)
        [output] = llm.generate([{"prompt_token_ids": prompt}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        logprobs[name] = torch.tensor([output.prompt_logprobs[i][prompt[i]].logprob
                                       for i in range(17, len(prompt))])
    # Measured on an Intel Xeon (AMX), 27 positions: mean |difference| 0.12 (E4M3) and 0.20
    # (E5M2, one mantissa bit fewer), largest 0.88 and 0.86, over logprobs averaging -3.6.
    for name, mean_bound in (("fp8", 0.3), ("fp8_e5m2", 0.45)):
        difference = (logprobs[name] - logprobs["auto"]).abs()
        assert 0 < difference.mean() < mean_bound and difference.max() < 2.5, difference


def test_bfloat16_is_selectable(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen2"], dtype="bfloat16", kv_cache_memory="8MiB")
    (runner,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    # bf16 products (weights packed for oneDNN in bf16), float32 activations (model/precision.py).
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert (qkv.packed_weight if qkv.packed_weight is not None else qkv.weight).dtype == \
        torch.bfloat16
    assert runner.model.model.norm.weight.dtype == torch.float32
    [output] = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 5
