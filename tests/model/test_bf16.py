"""The bfloat16 path (model/precision.py) against transformers in bfloat16, teacher-forced.

Tolerance. bfloat16 keeps 8 significant bits (a relative rounding of up to 2^-9 per value),
so two correct bf16 computations of a model agree only up to their own rounding errors, and
those depend on the model. The test measures that scale instead of guessing it: `budget` is
the largest |Δlogprob| between transformers in bf16 and transformers in float32 on the same
tokens (transformers' own bf16 error). tokenserve's bf16 path rounds less than that (its
activations stay float32; only the products' inputs and weights and the KV cache are bf16),
so its logprobs lie within `budget` of float32's, hence within 2 x budget of transformers'
bf16 ones (the triangle inequality): the bound asserted, plus 1e-3 for the float32 noise of
an engine vs a model. The sharper check is against float32: tokenserve's error must stay
within transformers' own bf16 error (on the tiny models ~0.1 nats against a budget of
~0.3-0.5). Top-1 agreement: every position whose best token leads
transformers' bf16 second best by more than 2 x budget has the same best token.

Teacher-forced over the prompt (prefill: oneDNN products, the prompt attention) and over
the engine's own greedy continuation (decode steps: the C attention reading the bf16 cache).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenserve import LLM, SamplingParams
from tokenserve.model.precision import auto_dtype

PROMPT_LEN, MAX_TOKENS = 48, 12


def _runner(llm: LLM):
    (runner,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
    return runner


def _hf_logprobs(path: str, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return logits.log_softmax(-1)  # row p: the distribution of token p + 1


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_bf16_path_matches_transformers_bf16_teacher_forced(tiny_model_dirs, family):
    path = tiny_model_dirs[family]
    rng = random.Random(7)
    prompt = [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="16MiB")
    runner = _runner(llm)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert (qkv.packed_weight if qkv.packed_weight is not None else qkv.weight).dtype == \
        torch.bfloat16
    [output] = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1,
                       prompt_logprobs=1),
        use_tqdm=False,
    )
    generated = list(output.outputs[0].token_ids)
    tokens = prompt + generated
    # Position p of `tokens` (p >= 1): the engine's logprob of tokens[p] and its best token.
    entries = list(output.prompt_logprobs[1:]) + list(output.outputs[0].logprobs)
    ours = torch.tensor([entries[p - 1][tokens[p]].logprob for p in range(1, len(tokens))])
    ours_best = [next(t for t, lp in entry.items() if lp.rank == 1) for entry in entries]

    hf_bf16 = _hf_logprobs(path, torch.bfloat16, tokens)
    hf_fp32 = _hf_logprobs(path, torch.float32, tokens)
    index = torch.arange(len(tokens) - 1)
    targets = torch.tensor(tokens[1:])
    budget = (hf_bf16 - hf_fp32)[:-1].abs().max().item()
    assert 0 < budget < 1.0, budget  # bf16 did round, and the model is not degenerate
    difference = (ours - hf_bf16[index, targets]).abs()
    assert difference.max().item() <= 2 * budget + 1e-3, (difference.max(), budget)
    # Within float32's reach too: the engine's bf16 error is no larger than transformers'.
    assert (ours - hf_fp32[index, targets]).abs().max().item() <= budget + 1e-3

    top2 = hf_bf16[:-1].topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > 2 * budget
    agree = torch.tensor(ours_best) == top2.indices[:, 0]
    assert clear.sum() >= 5  # enough positions decide (tiny random models are nearly flat)
    assert agree[clear].all()


@pytest.mark.auto_dtype
def test_auto_is_the_fast_dtype_of_this_cpu_and_float32_is_one_flag_away(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    auto = _runner(LLM(path, kv_cache_memory="8MiB"))
    fp32 = _runner(LLM(path, dtype="float32", kv_cache_memory="8MiB"))
    assert auto.config.model_config.torch_dtype == auto_dtype()
    assert auto.kv_caches[0].dtype == auto_dtype()
    assert fp32.config.model_config.dtype == "float32"
    assert fp32.kv_caches[0].dtype == torch.float32
    # Activations stay float32 either way (the C norms, rotary and attention serve both).
    assert auto.model.model.norm.weight.dtype == torch.float32


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_o_proj_hands_its_bf16_sums_to_the_norm_unchanged(tiny_model_dirs, family):
    """The attention's output is rounded to bf16 before o_proj, whose sums stay bf16 for
    the norm after: the very values of rounding inside the product and widening after."""
    llm = LLM(tiny_model_dirs[family], dtype="bfloat16", kv_cache_memory="8MiB")
    attention = _runner(llm).model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(3)
    attn_output = torch.randn(37, attention.num_heads, attention.head_dim, generator=generator)

    handed = attention.project_output(attn_output)

    widened = attention.o_proj(attn_output.reshape(37, attention.q_size))  # float32 in and out
    assert handed.dtype == torch.bfloat16 and widened.dtype == torch.float32
    assert torch.equal(handed.float(), widened)


@pytest.mark.parametrize("cpu_isa", ["avx2", "avx512", "auto"])
def test_the_swiglu_table_leaves_the_engines_outputs_unchanged(tiny_model_dirs, monkeypatch,
                                                                cpu_isa):
    """SwiGLU of bf16 gates from the silu table (kernels/csrc/silu_table.h) against the same
    kernel computing silu (gate_up widened to float32 first): the same logprobs, bit for bit,
    over a prompt step and decode steps, at each level."""
    from tokenserve.kernels import build
    from tokenserve.kernels import cpu_isa as levels
    from tokenserve.model.layers.activation import SiluAndMul

    if cpu_isa != "auto" and not set(levels.ISA_LEVELS[cpu_isa][0]) <= levels.cpu_flags():
        pytest.skip(f"this CPU lacks {cpu_isa}")
    prompt = [random.Random(11).randrange(3, 500) for _ in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    previous, table_calls = build.selected_isa(), []
    forward = SiluAndMul.forward

    def counted(self, gate_up, out_dtype=None):
        table_calls.append(gate_up.dtype == torch.bfloat16)
        return forward(self, gate_up, out_dtype)

    def computed(self, gate_up, out_dtype=None):
        return forward(self, gate_up.float(), out_dtype)

    def run() -> list:
        llm = LLM(tiny_model_dirs["llama"], dtype="bfloat16", cpu_isa=cpu_isa,
                  kv_cache_memory="8MiB")
        [output] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        entries = list(output.prompt_logprobs[1:]) + list(output.outputs[0].logprobs)
        return [sorted((t, lp.logprob) for t, lp in entry.items()) for entry in entries]

    try:
        monkeypatch.setattr(SiluAndMul, "forward", counted)
        with_table = run()
        monkeypatch.setattr(SiluAndMul, "forward", computed)
        without = run()
    finally:
        build.select_isa(previous)
    assert any(table_calls)  # the prompt step's gates were bf16: the table was read
    assert with_table == without
