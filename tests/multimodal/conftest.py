"""Tiny random vision-language models built at test time: LLaVA (a CLIP tower with a Llama
or Qwen2 language model) and Idefics3 (SmolVLM's architecture), each saved with its
processor (transformers' own) to a temporary directory. Real VLM weights cannot be
downloaded here.

Images are small random pictures; the references are transformers' models given the
pixels their processors make.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.conftest import tiny_model_config, write_tiny_tokenizer

IMAGE_TOKEN = "<image>"
# A chat template that renders image parts as the image token (a processor's own template).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def random_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _vision_config(cls, **overrides):
    settings = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "initializer_range": 0.25,
    }
    settings.update(overrides)
    return cls(**settings)


def build_tiny_llava(
    directory: str | Path,
    text_family: str = "llama",
    tower: str = "clip",
    image_size: int = 56,
    seed: int = 0,
) -> str:
    """LLaVA with a CLIP tower (its class token dropped: the "default" strategy) or a SigLIP
    one (every patch: "full"): (image_size / 14)² image tokens per image."""
    tokenizer = write_tiny_tokenizer(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text_config = tiny_model_config(text_family, vocab_size=len(tokenizer))
    clip = tower == "clip"
    if clip:
        vision_config = _vision_config(
            transformers.CLIPVisionConfig, image_size=image_size, patch_size=14, projection_dim=32
        )
    else:
        vision_config = _vision_config(
            transformers.SiglipVisionConfig, image_size=image_size, patch_size=14
        )
    strategy = "default" if clip else "full"
    config = transformers.LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
        projector_hidden_act="gelu", vision_feature_select_strategy=strategy,
        vision_feature_layer=-2 if clip else -1, image_seq_length=(image_size // 14) ** 2,
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlavaForConditionalGeneration(config)
    if clip:
        image_processor = transformers.CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        )
    else:
        image_processor = transformers.SiglipImageProcessor(
            size={"height": image_size, "width": image_size}
        )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1 if clip else 0,
        chat_template=VLM_CHAT_TEMPLATE,
    )
    model.save_pretrained(str(directory))
    processor.save_pretrained(str(directory))
    return str(directory)


def build_tiny_idefics3(directory: str | Path, seed: int = 0) -> str:
    """Idefics3: 16-pixel tiles of 4-pixel patches, pixel shuffle 2 → 4 image tokens a tile;
    an image up to 32 pixels is split into up to 2×2 tiles plus its global view."""
    tokenizer = write_tiny_tokenizer(directory)
    extra = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
    extra += [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    text_config = tiny_model_config("llama", vocab_size=len(tokenizer))
    vision_config = _vision_config(transformers.Idefics3VisionConfig, image_size=16, patch_size=4)
    config = transformers.Idefics3Config(
        vision_config=vision_config, text_config=text_config, scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.Idefics3ForConditionalGeneration(config)
    image_processor = transformers.Idefics3ImageProcessor(
        size={"longest_edge": 32}, max_image_size={"longest_edge": 16}
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
        chat_template=VLM_CHAT_TEMPLATE,
    )
    model.save_pretrained(str(directory))
    processor.save_pretrained(str(directory))
    return str(directory)


def hf_generate(model_dir: str, prompt: str, images: list[Image.Image], max_new_tokens: int):
    """transformers' greedy tokens for `prompt` and `images`: (prompt ids, new token ids)."""
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens
        )
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, output[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="session")
def tiny_llava_siglip_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """LLaVA with a SigLIP tower and a Qwen2 language model (tied embeddings, qkv bias)."""
    return build_tiny_llava(
        tmp_path_factory.mktemp("tiny_llava_siglip_qwen2"), text_family="qwen2", tower="siglip"
    )


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3"))
