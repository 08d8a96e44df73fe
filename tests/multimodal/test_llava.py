"""LLaVA end to end, offline: greedy tokens equal transformers' for the same pixels (one
image, two images, an image split across prompt chunks, preemption), the prompt's ids are
the processor's (placeholders expanded), the prefix cache shares blocks only for the same
image, a repeated image is encoded once, and bad image inputs are ValueErrors."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from tests.multimodal.conftest import hf_generate, random_image
from tokenserve.engine.async_llm import AsyncLLM
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_model_len": 512}
LONG_TEXT = (
    "Once upon a time there was a small village at the edge of a great forest. Every "
    "morning the baker opened his shop and the children walked to school. "
)


def encoder_runs(llm: LLM) -> int:
    (runs,) = llm.llm_engine.collective_rpc(
        lambda worker: worker.model_runner.encoder_runner.num_encoder_runs
    )
    return runs


def generate(llm: LLM, prompt: str, images):
    [output] = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False
    )
    return output


@pytest.fixture(scope="module")
def llava(tiny_llava_dir: str) -> LLM:
    return LLM(tiny_llava_dir, **ENGINE)


@pytest.mark.parametrize(
    "prompt, seeds",
    [
        ("Hello <image> what is this?", [1]),
        ("<image> and <image>: which is brighter?", [2, 3]),
    ],
    ids=["one_image", "two_images"],
)
def test_matches_transformers(llava: LLM, tiny_llava_dir: str, prompt: str, seeds: list[int]):
    images = [random_image(seed) for seed in seeds]
    expected_prompt, expected = hf_generate(tiny_llava_dir, prompt, images, MAX_TOKENS)
    output = generate(llava, prompt, images if len(images) > 1 else images[0])
    assert output.prompt_token_ids == expected_prompt  # placeholders expanded as transformers
    assert output.outputs[0].token_ids == expected


def test_token_id_prompt_is_expanded(llava: LLM, tiny_llava_dir: str):
    image = random_image(4)
    expected_prompt, expected = hf_generate(tiny_llava_dir, "A <image> B", [image], MAX_TOKENS)
    tokenizer = llava.get_tokenizer()
    [output] = llava.generate(
        {"prompt_token_ids": tokenizer.encode("A <image> B"), "multi_modal_data": {"image": image}},
        GREEDY, use_tqdm=False,
    )
    assert output.prompt_token_ids == expected_prompt
    assert output.outputs[0].token_ids == expected


def test_image_across_prompt_chunks(tiny_llava_dir: str):
    """A budget of 8 tokens splits the prompt and the image's 16 placeholders across steps;
    the image's encoder output (larger than the encoder budget) is computed once."""
    llm = LLM(tiny_llava_dir, max_num_batched_tokens=8, **ENGINE)
    prompt = LONG_TEXT + "<image> What happened next? " + "<image> The end."
    images = [random_image(5), random_image(6)]
    _, expected = hf_generate(tiny_llava_dir, prompt, images, MAX_TOKENS)
    assert generate(llm, prompt, images).outputs[0].token_ids == expected
    assert encoder_runs(llm) == 2


def test_prefix_cache_shares_blocks_of_the_same_image_only(llava: LLM, tiny_llava_dir: str):
    prompt = LONG_TEXT + "<image> Describe it in detail, please, with many words."
    first, other = random_image(7), random_image(8)
    generate(llava, prompt, first)
    again = generate(llava, prompt, first)
    image_start = again.prompt_token_ids.index(llava.get_tokenizer().convert_tokens_to_ids("<image>"))
    image_end = image_start + 16
    # The same image: blocks past the image are reused.
    assert again.num_cached_tokens >= image_end
    different = generate(llava, prompt, other)
    # Another image: only the blocks before it.
    assert 0 < different.num_cached_tokens <= image_start
    _, expected = hf_generate(tiny_llava_dir, prompt, [other], MAX_TOKENS)
    assert different.outputs[0].token_ids == expected


def test_repeated_image_is_encoded_once(tiny_llava_dir: str):
    llm = LLM(tiny_llava_dir, enable_prefix_caching=False, **ENGINE)
    image = random_image(9)
    outputs = llm.generate(
        [
            {"prompt": f"Question {i}: what is in <image>?", "multi_modal_data": {"image": image}}
            for i in range(3)
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert encoder_runs(llm) == 1
    _, expected = hf_generate(tiny_llava_dir, "Question 2: what is in <image>?", [image], MAX_TOKENS)
    assert outputs[2].outputs[0].token_ids == expected


def test_preemption_keeps_outputs_token_exact(tiny_llava_dir: str):
    llm = LLM(
        tiny_llava_dir, block_size=16, num_kv_blocks=9, max_model_len=128,
        admission_lookahead_tokens=0, max_num_batched_tokens=64,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [f"Picture {i}: <image> Tell me about it." for i in range(4)]
    images = [random_image(10 + i) for i in range(4)]
    outputs = llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)],
        params,
        use_tqdm=False,
    )
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for prompt, image, output in zip(prompts, images, outputs):
        _, expected = hf_generate(tiny_llava_dir, prompt, [image], 24)
        assert output.outputs[0].token_ids == expected


def test_siglip_tower_and_qwen2_language_model(tiny_llava_siglip_qwen2_dir: str):
    llm = LLM(tiny_llava_siglip_qwen2_dir, **ENGINE)
    image = random_image(20)
    _, expected = hf_generate(tiny_llava_siglip_qwen2_dir, "Look: <image>!", [image], MAX_TOKENS)
    assert generate(llm, "Look: <image>!", image).outputs[0].token_ids == expected


def test_bad_image_inputs_are_value_errors(llava: LLM):
    image = random_image(1)
    with pytest.raises(ValueError, match="placeholder"):
        generate(llava, "no placeholder here", image)
    with pytest.raises(ValueError, match="placeholder"):
        generate(llava, "<image> and <image>", image)
    with pytest.raises(ValueError, match="PIL image"):
        generate(llava, "<image>", "not an image")
    with pytest.raises(ValueError, match="modality"):
        llava.generate({"prompt": "<image>", "multi_modal_data": {"video": image}}, GREEDY)
    # The engine keeps serving.
    assert generate(llava, "<image>", image).outputs[0].token_ids


def test_limit_mm_per_prompt(tiny_llava_dir: str):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt='{"image": 1}', **ENGINE)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        generate(llm, "<image> <image>", [random_image(1), random_image(2)])
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(tiny_llava_dir, limit_mm_per_prompt={"image": -1}, **ENGINE)


def test_text_only_model_refuses_images(tiny_model_dirs: dict[str, str]):
    llm = LLM(tiny_model_dirs["llama"], **ENGINE)
    with pytest.raises(ValueError, match="takes no images"):
        generate(llm, "Hello", random_image(1))


def test_chat_template_comes_from_the_processor(tiny_llava_dir: str, tmp_path):
    """A template kept only in the processor's chat_template.json reaches the tokenizer that
    renders chats."""
    model_dir = tmp_path / "llava"
    shutil.copytree(tiny_llava_dir, model_dir)
    template_file = model_dir / "chat_template.jinja"
    (model_dir / "chat_template.json").write_text(
        json.dumps({"chat_template": template_file.read_text()})
    )
    template_file.unlink()
    tokenizer = LLM(str(model_dir), **ENGINE).get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False,
    )
    assert "<image>Hi" in text


def test_async_engine_process(tiny_llava_dir: str):
    """Images reach an engine core in its own process (msgpack over ZMQ) and give the same
    tokens, two concurrent requests sharing one image."""
    image = random_image(30)
    prompts = ["One: <image>?", "Two: <image>!"]

    async def run() -> list[list[int]]:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llava_dir, **ENGINE))
        try:

            async def one(index: int, prompt: str) -> list[int]:
                request = {"prompt": prompt, "multi_modal_data": {"image": image}}
                async for output in engine.generate(request, GREEDY, f"req-{index}"):
                    if output.finished:
                        return output.outputs[0].token_ids
                raise AssertionError("no final output")

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            engine.shutdown()

    for prompt, tokens in zip(prompts, asyncio.run(run())):
        assert tokens == hf_generate(tiny_llava_dir, prompt, [image], MAX_TOKENS)[1]
