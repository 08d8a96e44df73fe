"""An image through the whole server: the `openai` client sends a chat with an image part
to `tokenserve serve` on a tiny LLaVA, and the answer is transformers' greedy answer for the
same pixels and the same rendered prompt. Also: the prompt's image tokens count in usage,
a repeated image reports cached tokens, and a text-only chat still works on a VLM."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import openai
import pytest
import transformers
from PIL import Image

from tests.entrypoints.openai.remote_server import RemoteServer
from tests.multimodal.conftest import hf_generate, random_image

MAX_TOKENS = 6


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(image: Image.Image, text: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": text},
            ],
        }
    ]


@pytest.fixture(scope="module")
def llava_server(tiny_llava_dir: str) -> Iterator[RemoteServer]:
    server = RemoteServer(
        tiny_llava_dir, "--kv-cache-memory", "32MiB", "--max-model-len", "512",
        "--block-size", "8",
    )
    yield server
    server.stop()


def test_openai_client_gets_the_models_answer_to_an_image(
    llava_server: RemoteServer, tiny_llava_dir: str
):
    client = llava_server.client()
    image = random_image(11)
    messages = image_message(image, "What is in the picture?")
    reply = client.chat.completions.create(
        model=tiny_llava_dir, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, extra_body={"ignore_eos": True},
    )
    # The reference: the processor's own chat template, its image token in place of the part.
    processor = transformers.AutoProcessor.from_pretrained(tiny_llava_dir)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                         "text": "What is in the picture?"}]}],
        add_generation_prompt=True,
    )
    prompt_ids, expected = hf_generate(tiny_llava_dir, prompt, [image], MAX_TOKENS)
    tokenizer = processor.tokenizer
    # Token by token (the text may hold back a trailing partial UTF-8 character).
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    assert tokens == [tokenizer.decode([token_id]) for token_id in expected]
    assert tokenizer.decode(expected).startswith(reply.choices[0].message.content)
    assert reply.usage.prompt_tokens == len(prompt_ids)  # the image's tokens count
    assert reply.usage.completion_tokens == MAX_TOKENS

    # The same image again: its blocks come from the prefix cache; a different one's do not.
    again = client.chat.completions.create(
        model=tiny_llava_dir, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].message.content == reply.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(prompt_ids) - 8 - 1  # all but the last (partial) block
    other = client.chat.completions.create(
        model=tiny_llava_dir, messages=image_message(random_image(12), "What is in the picture?"),
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
    )
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) < cached


def test_text_only_chat_and_bad_image_on_a_vlm_server(llava_server: RemoteServer, tiny_llava_dir: str):
    client = llava_server.client()
    reply = client.chat.completions.create(
        model=tiny_llava_dir, messages=[{"role": "user", "content": "Hello"}], max_tokens=3,
        temperature=0,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    broken = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
    ]}]
    with pytest.raises(openai.BadRequestError) as refusal:
        client.chat.completions.create(model=tiny_llava_dir, messages=broken, max_tokens=3)
    assert refusal.value.status_code == 400
    # Still serving.
    assert client.chat.completions.create(
        model=tiny_llava_dir, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
    ).choices
