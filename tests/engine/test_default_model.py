"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1) served end to end."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenserve import LLM, SamplingParams
from tokenserve.attention.backend import AttentionMetadata
from tokenserve.model.loader import iterate_quantized_weights, iterate_weights
from tokenserve.model.registry import build_model


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(kv_cache_memory="256MiB")


def test_chat_answers_paris(default_llm):
    [output] = default_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason in ("stop", "length")


def _logits_for_prompt(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Every position's logits from our model, for one prompt written into fresh blocks."""
    runner = llm.llm_engine.engine_core.model_runner
    block_size = runner.block_size
    num_blocks = -(-len(token_ids) // block_size)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(len(token_ids)),
        query_start_loc=[0, len(token_ids)],
        seq_lens=[len(token_ids)],
        block_tables=[list(range(num_blocks))],
        block_size=block_size,
    )
    runner.attention.prepare(metadata, runner.device)
    with torch.inference_mode():
        hidden = runner.model(
            torch.tensor(token_ids), torch.arange(len(token_ids)), runner.kv_caches, metadata
        )
        return runner.model.compute_logits(hidden)


def test_gguf_logits_equal_transformers(default_llm, default_model_path):
    tokenizer = default_llm.get_tokenizer()
    token_ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is")
    reference = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path),
        gguf_file=os.path.basename(default_model_path),
        dtype=torch.float32,
    ).eval()
    with torch.inference_mode():
        expected = reference(torch.tensor([token_ids])).logits[0]
    ours = _logits_for_prompt(default_llm, token_ids)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_too_long_prompt_is_refused_and_engine_keeps_serving(default_llm):
    max_model_len = default_llm.llm_engine.config.model_config.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        default_llm.generate([[1] * (max_model_len + 5)], use_tqdm=False)
    [output] = default_llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )
    assert len(output.outputs[0].token_ids) == 4
    assert default_llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_gguf_block_copies_hold_the_float_weights(default_llm):
    """The quantized decode path multiplies by the very weights of the float32 path: each
    block copy (fused, q/k rows reordered) dequantizes bit for bit to its float32 weight."""
    runner = default_llm.llm_engine.engine_core.model_runner
    model_config = runner.config.model_config
    model = build_model(model_config, runner.attention)  # unpacked: the float weights stay
    model.load_weights(iterate_weights(model_config.files))
    count = model.load_quantized_weights(iterate_quantized_weights(model_config.files))
    assert count == 4 * len(model.layers) + 1
    for layer in (model.layers[0], model.layers[-1]):
        assert set(layer.quantized) == {"qkv_weight", "o_weight", "gate_up_weight", "down_weight"}
        for name, weight in layer.quantized.items():
            assert torch.equal(weight.dequantize(), getattr(layer, name)), name
    assert torch.equal(model.quantized_logits.dequantize(), model.embed_tokens)


def test_greedy_output_same_with_and_without_the_quantized_path(default_llm):
    model = default_llm.llm_engine.engine_core.model_runner.model
    copies = [model.quantized_logits, *(w for layer in model.layers for w in layer.quantized.values())]
    assert all(copy is not None for copy in copies) and copies[0].max_rows > 0
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=32)

    def greedy() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in default_llm.generate(prompts, params, use_tqdm=False)]

    with_blocks = greedy()
    limits = [(copy.max_rows, copy.gemm_max_rows) for copy in copies]
    try:
        for copy in copies:
            copy.max_rows = copy.gemm_max_rows = 0  # every product on the float32 weights
        without_blocks = greedy()
    finally:
        for copy, (limit, gemm_limit) in zip(copies, limits):
            copy.max_rows, copy.gemm_max_rows = limit, gemm_limit
    assert with_blocks == without_blocks
