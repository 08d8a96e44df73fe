"""/v1/chat/completions through the official openai client, and chat-template rendering."""

from __future__ import annotations

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME, stop_string_inside

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def chat(client, messages=MESSAGES, **kwargs):
    return client.chat.completions.create(model=TINY_MODEL_NAME, messages=messages, **kwargs)


def tokenize(server, **body) -> list[int]:
    with server.http() as http:
        response = http.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]


def detokenize(server, tokens: list[int]) -> str:
    with server.http() as http:
        return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_chat_completion(tiny_server, tiny_client):
    response = chat(tiny_client, max_completion_tokens=8, **GREEDY)
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert response.object == "chat.completion"
    assert response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens == len(tokenize(tiny_server, messages=MESSAGES))


def test_chat_streaming_equals_non_streaming(tiny_client):
    expected = chat(tiny_client, max_tokens=10, **GREEDY).choices[0].message.content
    chunks = list(
        chat(
            tiny_client,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert content == expected
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == [
        "length"
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_n_and_logprobs(tiny_client):
    response = chat(
        tiny_client,
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=1,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 10
    for choice in response.choices:
        content = choice.logprobs.content
        assert len(content) == 5
        for entry in content:
            assert entry.logprob <= 0.0
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.bytes == list(entry.token.encode())


def test_chat_stop_string(tiny_client):
    full = chat(tiny_client, max_tokens=24, **GREEDY).choices[0].message.content
    stop = stop_string_inside(full)
    choice = chat(tiny_client, max_tokens=24, stop=stop, **GREEDY).choices[0]
    assert choice.message.content == full[: full.index(stop)]
    assert choice.finish_reason == "stop"


def test_generation_prompt_and_continue_final_message(tiny_server):
    with_prompt = detokenize(tiny_server, tokenize(tiny_server, messages=MESSAGES))
    without = detokenize(
        tiny_server, tokenize(tiny_server, messages=MESSAGES, add_generation_prompt=False)
    )
    assert with_prompt == without + "<|im_start|>assistant\n"
    partial = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    continued = detokenize(
        tiny_server,
        tokenize(
            tiny_server, messages=partial, add_generation_prompt=False, continue_final_message=True
        ),
    )
    assert continued.endswith("<|im_start|>assistant\nThe capital is")


def test_continue_final_message_with_echo(tiny_client):
    partial = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    response = chat(
        tiny_client,
        messages=partial,
        max_tokens=3,
        temperature=0.0,
        extra_body={
            "ignore_eos": True,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
        },
    )
    assert response.choices[0].message.content.startswith("The capital is")


def test_request_chat_template_and_kwargs(tiny_server, tiny_client):
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tokens = tokenize(
        tiny_server,
        messages=MESSAGES,
        chat_template=template,
        chat_template_kwargs={"greeting": "Hi: "},
    )
    assert detokenize(tiny_server, tokens) == "Hi: [What is the capital of France?]"
    response = chat(
        tiny_client,
        max_tokens=2,
        **{
            **GREEDY,
            "extra_body": {
                "ignore_eos": True,
                "chat_template": template,
                "chat_template_kwargs": {"greeting": "Hi: "},
            },
        },
    )
    assert response.usage.prompt_tokens == len(tokens)


def test_content_parts_are_joined(tiny_server):
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    text = detokenize(tiny_server, tokenize(tiny_server, messages=parts))
    assert "What is the capital\nof France?" in text
