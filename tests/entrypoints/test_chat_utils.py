"""Chat content parts: the template's content format (detected as vLLM does), image parts
rendered for "string" and "openai" templates, text-only conversations as before, and
LLM.chat handing images on as `multi_modal_data`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import transformers
from PIL import Image

from tests.conftest import CHATML_TEMPLATE
from tests.multimodal.media_server import MediaServer
from tokenserve.entrypoints.chat_utils import (
    ChatContentConfig,
    detect_content_format,
    render_chat,
    render_chat_prompt,
    resolve_content_format,
)
from tokenserve.multimodal.media_security import MediaAddressRefused

# LLaVA's (images first, then text, through selectattr) and Idefics3's (parts in order).
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] + ' ' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Both shapes of content, as Qwen2-VL's template takes them.
HYBRID_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[img]{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}"
)
# A renamed message list and a renamed content, looped over.
RENAMED_TEMPLATE = (
    "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% set parts = m.content %}"
    "{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}"
)
LLAMA_LIKE_TEMPLATE = (
    "{% set loop_messages = messages[1:] %}{% set system = messages[0]['content'] %}"
    "{{ system }}{% for message in loop_messages %}{{ message['content'] | trim }}{% endfor %}"
)
URL_1, URL_2 = "https://example.com/cat.png", "https://example.com/dog.png"
TWO_IMAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": URL_1, "detail": "low"}},
            {"type": "text", "text": "And this?"},
            {"type": "image_url", "image_url": {"url": URL_2}},
        ],
    }
]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: str) -> Any:
    """The tiny BPE with its ChatML template (a "string" one)."""
    return transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (LLAVA_TEMPLATE, "openai"),
        (IDEFICS3_TEMPLATE, "openai"),
        (HYBRID_TEMPLATE, "openai"),
        (RENAMED_TEMPLATE, "openai"),
        (CHATML_TEMPLATE, "string"),
        (LLAMA_LIKE_TEMPLATE, "string"),
        ("{% for x in %}", "string"),  # does not parse
    ],
)
def test_content_format_is_detected_from_the_template(template, expected):
    assert detect_content_format(template) == expected


def test_content_format_option_and_template_choice(tokenizer):
    assert resolve_content_format("auto", tokenizer, None) == "string"  # the model's ChatML
    assert resolve_content_format("auto", tokenizer, IDEFICS3_TEMPLATE) == "openai"
    assert resolve_content_format("string", tokenizer, IDEFICS3_TEMPLATE) == "string"
    assert resolve_content_format("openai", tokenizer, None) == "openai"


def test_text_only_conversations_render_as_before(tokenizer):
    """String content and text parts reach a "string" template as one string, as they did."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Bye"},
    ]
    expected = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi\nthere"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Bye"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert render_chat(tokenizer, messages) == expected
    assert render_chat_prompt(tokenizer, messages).images == []


def test_string_templates_get_a_placeholder_per_image(tokenizer):
    prompt = render_chat_prompt(tokenizer, TWO_IMAGES)
    assert prompt.images == [URL_1, URL_2]
    assert prompt.text == (
        "<|im_start|>user\n<image>\n<image>\nWhat is this?\nAnd this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    custom = render_chat_prompt(tokenizer, TWO_IMAGES, content=ChatContentConfig(
        image_placeholder="<|image|>"))
    assert "user\n<|image|>\n<|image|>\nWhat is this?" in custom.text


def test_placeholders_the_user_wrote_count(tokenizer):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Left <image> and right:"},
                {"type": "image_url", "image_url": {"url": URL_1}},
                {"type": "image_url", "image_url": URL_2},  # the URL itself, as vLLM takes it
            ],
        }
    ]
    prompt = render_chat_prompt(tokenizer, messages)
    assert "user\n<image>\nLeft <image> and right:<|im_end|>" in prompt.text
    assert prompt.images == [URL_1, URL_2]
    messages[0]["content"] = messages[0]["content"][:2]
    messages[0]["content"][0] = {"type": "text", "text": "<image> <image>"}
    with pytest.raises(ValueError, match="more '<image>' placeholders than images"):
        render_chat_prompt(tokenizer, messages)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (
            IDEFICS3_TEMPLATE,
            "<|im_start|>User:What is this?<image>And this?<image><end_of_utterance>\nAssistant:",
        ),
        (LLAVA_TEMPLATE, "USER: <image>\n<image>\nWhat is this? And this? ASSISTANT:"),
        (HYBRID_TEMPLATE, "user: What is this?[img]And this?[img]"),  # the last newline dropped
    ],
)
def test_openai_templates_get_image_parts_in_place(tokenizer, template, expected):
    prompt = render_chat_prompt(tokenizer, TWO_IMAGES, chat_template=template)
    assert prompt.text == expected
    assert prompt.images == [URL_1, URL_2]


def test_openai_templates_get_text_only_content_as_parts(tokenizer):
    messages = [{"role": "user", "content": "Hello"}]
    assert render_chat(tokenizer, messages, chat_template=IDEFICS3_TEMPLATE) == (
        "<|im_start|>User:Hello<end_of_utterance>\nAssistant:"
    )


def test_bad_parts_and_too_many_images_are_refused(tokenizer):
    def user(*parts: dict) -> list[dict]:
        return [{"role": "user", "content": list(parts)}]

    with pytest.raises(ValueError, match="'input_audio' is not supported"):
        render_chat_prompt(tokenizer, user({"type": "input_audio", "input_audio": {}}))
    with pytest.raises(ValueError, match="needs"):
        render_chat_prompt(tokenizer, user({"type": "image_url", "image_url": {"detail": "low"}}))
    with pytest.raises(ValueError, match="PIL image"):
        render_chat_prompt(tokenizer, user({"type": "image_pil", "image_pil": "cat.png"}))
    with pytest.raises(ValueError, match="At most 1 image"):
        render_chat_prompt(tokenizer, TWO_IMAGES, content=ChatContentConfig(
            max_images_per_prompt=1))
    with pytest.raises(ValueError, match="chat completions only"):
        render_chat(tokenizer, TWO_IMAGES)
    with pytest.raises(ValueError, match="content format"):
        ChatContentConfig(content_format="list")
    image = Image.new("RGB", (2, 2))
    assert render_chat_prompt(
        tokenizer, user({"type": "image_pil", "image_pil": image})
    ).images == [image]


@pytest.fixture(scope="module")
def media_server() -> Iterator[MediaServer]:
    server = MediaServer()
    yield server
    server.stop()


def test_llm_chat_fetches_images_into_multi_modal_data(tiny_model_dirs, media_server, monkeypatch):
    """LLM.chat hands `{"prompt", "prompt_token_ids", "multi_modal_data": {"image": [PIL]}}`
    to generate; the image URL on 127.0.0.1 is refused unless the LLM was given that
    network."""
    from tokenserve.entrypoints.llm import LLM

    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=16, block_size=16,
              allowed_media_networks=["127.0.0.1/32"])
    given: list[Any] = []
    monkeypatch.setattr(llm, "generate", lambda prompts, *args, **kwargs: given.extend(prompts))
    image_part = {"type": "image_url", "image_url": {"url": media_server.url("/image.png")}}
    llm.chat([{"role": "user", "content": [image_part, {"type": "text", "text": "Describe."}]}])
    [prompt] = given
    assert prompt["prompt"] == "<|im_start|>user\n<image>\nDescribe.<|im_end|>\n<|im_start|>assistant\n"
    [image] = prompt["multi_modal_data"]["image"]
    assert image.size == (8, 6)
    # The template wrote the special tokens: the ids are the text's, none added (no 2nd BOS).
    tokenizer = llm.get_tokenizer()
    assert prompt["prompt_token_ids"] == tokenizer.encode(prompt["prompt"], add_special_tokens=False)

    given.clear()
    llm.chat([{"role": "user", "content": "Hi"}])
    assert given[0]["prompt_token_ids"] and "multi_modal_data" not in given[0]

    llm.media_connector.config = type(llm.media_connector.config)()  # the defaults
    with pytest.raises(MediaAddressRefused, match="loopback"):
        llm.chat([{"role": "user", "content": [image_part]}])
