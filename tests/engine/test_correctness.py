"""Greedy outputs equal transformers' `generate` token for token, whatever the batching,
chunking, prefix-cache hits or preemptions (DESIGN.md's central invariant)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenserve import LLM, SamplingParams

MAX_TOKENS = 24
PROMPT_LENGTHS = (1, 5, 17, 33, 64, 100, 250)

SETTINGS = {
    "default": dict(),
    "forced_chunking": dict(max_num_batched_tokens=16),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    # 20 blocks of 16 tokens cannot hold all nine requests at once: without admission
    # lookahead, prompts that fit are admitted and the newest preempted as they grow.
    "preemption": dict(
        num_kv_blocks=20, block_size=16, max_model_len=300, admission_lookahead_tokens=0
    ),
    # The same cache with lookahead (the default): requests wait instead, no preemption.
    "kv_pressure_lookahead": dict(num_kv_blocks=20, block_size=16, max_model_len=300),
}


@pytest.fixture(scope="module")
def prompts(tiny_model_dirs) -> list[list[int]]:
    config = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"]).config
    rng = random.Random(0)
    # Two prompts share a 160-token prefix so that prefix caching has something to hit: a
    # whole block at the default block size (128), and whole blocks of 16 too.
    shared = [rng.randrange(3, config.vocab_size) for _ in range(160)]
    result = [[rng.randrange(3, config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    result.append(shared + [5, 6, 7])
    result.append(shared + [8, 9])
    return result


@pytest.fixture(scope="module")
def references(tiny_model_dirs, prompts) -> dict[str, list[list[int]]]:
    expected = {}
    for name, path in tiny_model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # The engine runs with ignore_eos: the reference must not stop at (or ban) EOS either.
        model.generation_config.eos_token_id = None
        outputs = []
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt):].tolist())
        expected[name] = outputs
    return expected


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2"])
def test_greedy_matches_transformers(tiny_model_dirs, prompts, references, architecture, setting):
    llm = LLM(tiny_model_dirs[architecture], kv_cache_memory="64MiB", **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, expected in zip(outputs, references[architecture]):
        assert output.outputs[0].token_ids == expected
        assert output.outputs[0].finish_reason == "length"
    stats = llm.llm_engine.get_stats()
    if setting == "preemption":
        assert stats.num_preemptions > 0
    else:
        assert stats.num_preemptions == 0
    if setting == "no_prefix_caching":
        assert stats.prefix_cache_hits == 0
    elif setting == "default":
        assert stats.prefix_cache_hits >= 128  # the shared prefix's first block hit
    assert stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_pure_torch_path_matches_transformers(tiny_model_dirs, prompts, references, architecture):
    """No C kernels and no oneDNN packing: the fallback path of a machine without them."""
    llm = LLM(tiny_model_dirs[architecture], kv_cache_memory="64MiB", max_num_batched_tokens=64,
              disable_c_kernels=True, disable_onednn=True)
    (runner,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
    assert runner.attention.ops is None
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed_weight is None and layer.input_layernorm.ops is None
    assert layer.self_attn.rotary_emb.ops is None and layer.mlp.act_fn.ops is None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, expected in zip(outputs, references[architecture]):
        assert output.outputs[0].token_ids == expected


def test_default_path_uses_the_cpu_kernels(tiny_model_dirs):
    """The test above is about the fallback; the suite's other tests run this path."""
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="64MiB")
    (runner,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
    assert runner.attention.ops is not None
    layer = runner.model.model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj, runner.model.lm_head)
    assert all(linear.packed_weight is not None for linear in linears)
    assert runner.model.model.norm.ops is not None and layer.self_attn.rotary_emb.ops is not None
