"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1) served end to end."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenserve import LLM, SamplingParams
from tokenserve.attention.backend import CommonAttentionMetadata
from tokenserve.config import KernelConfig
from tokenserve.model.loader import iterate_quantized_weights, iterate_weights
from tokenserve.model.registry import build_model, process_weights_after_loading


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


def test_max_tokens_inside_a_character_drops_it(default_llm):
    """Issue 25: these max_tokens end inside an emoji; the text ends before it, no U+FFFD."""
    conversation = [{"role": "user", "content": "Repeat exactly: 🎉🚀 naïve café 日本語 😀"}]
    lengths = (38, 40, 41)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths]
    outputs = default_llm.chat([conversation] * len(lengths), params, use_tqdm=False)
    tokenizer = default_llm.get_tokenizer()
    for output in outputs:
        [completion] = output.outputs
        assert completion.finish_reason == "length"
        assert "\ufffd" not in completion.text
        # The cut is real: the tokens' own decode ends in the replacement character.
        full = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert full.endswith("\ufffd") and completion.text == full.rstrip("\ufffd")


def _logits_for_prompt(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Every position's logits from our model, for one prompt written into fresh blocks."""
    (runner,) = llm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
    block_size = runner.block_size
    num_blocks = -(-len(token_ids) // block_size)
    metadata = runner.attention.build_metadata(CommonAttentionMetadata(
        slot_mapping=torch.arange(len(token_ids)),
        query_start_loc=[0, len(token_ids)],
        seq_lens=[len(token_ids)],
        block_tables=[list(range(num_blocks))],
        block_size=block_size,
    ))
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
    (runner,) = default_llm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
    model_config = runner.config.model_config
    # Not packed for oneDNN: the float weights stay.
    model = build_model(model_config, runner.attention, KernelConfig(disable_onednn=True))
    files = model_config.files
    model.load_weights(itertools.chain(iterate_weights(files), iterate_quantized_weights(files)))
    process_weights_after_loading(model)
    assert model.linear_method.num_block_weights == 4 * len(model.model.layers) + 1
    for layer in (model.model.layers[0], model.model.layers[-1]):
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert torch.equal(linear.blocks.dequantize(), linear.weight)
    assert torch.equal(model.lm_head.blocks.dequantize(), model.model.embed_tokens.weight)


def test_greedy_output_same_with_and_without_the_quantized_path(default_llm):
    (model,) = default_llm.llm_engine.collective_rpc(lambda worker: worker.model_runner.model)
    copies = [module.blocks for module in model.modules()
              if getattr(module, "blocks", None) is not None]
    assert len(copies) == 4 * len(model.model.layers) + 1
    assert all(copy is not None for copy in copies) and copies[0].max_rows > 0
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=32)

    def greedy() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in default_llm.generate(prompts, params, use_tqdm=False)]

    with_blocks = greedy()
    limits = [(copy.max_rows, copy.gemm_max_rows) for copy in copies]
    layer_stack = model.model.layer_stack
    try:
        for copy in copies:
            copy.max_rows = copy.gemm_max_rows = 0  # every product on the float32 weights
        layer_stack.enabled = False  # the fused layer reads the blocks too
        without_blocks = greedy()
    finally:
        for copy, (limit, gemm_limit) in zip(copies, limits):
            copy.max_rows, copy.gemm_max_rows = limit, gemm_limit
        layer_stack.enabled = True
    assert with_blocks == without_blocks
