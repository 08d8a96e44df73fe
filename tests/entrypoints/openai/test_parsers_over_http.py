"""--tool-call-parser hermes and --reasoning-parser deepseek_r1 over HTTP, on a tiny model
driven by structured outputs to write `<think>...</think>` and `<tool_call>...</tool_call>`
(the server constrains the reasoning too: --structured-outputs-config.enable_in_reasoning).
Also the chat stream handler fed one output per token, where chunk boundaries are fixed."""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.entrypoints.openai.parser_streams import token_pieces
from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME, RemoteServer
from tests.entrypoints.openai.test_structured_outputs import serving_chat
from tokenserve.entrypoints.openai.protocol import ChatCompletionRequest
from tokenserve.outputs import CompletionOutput, RequestOutput
from tokenserve.sampling_params import SamplingParams

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
THINK = r"<think>[a-z ]{1,10}</think>"
CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}"\}\}\n</tool_call>'
)
# A template that turns thinking off: the prompt closes the reasoning itself (Qwen3's way).
NO_THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, str]) -> Iterator[RemoteServer]:
    server = RemoteServer(
        tiny_model_dirs["llama"],
        "--served-model-name",
        TINY_MODEL_NAME,
        "--kv-cache-memory",
        "32MiB",
        "--max-model-len",
        "512",
        "--block-size",
        "8",
        "--trust-request-chat-template",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "deepseek_r1",
        "--structured-outputs-config.enable_in_reasoning=true",
    )
    yield server
    server.stop()


def forced(regex: str, **fields) -> dict:
    return {
        "model": TINY_MODEL_NAME,
        "messages": MESSAGES,
        "temperature": 0.0,
        "max_tokens": 120,
        "structured_outputs": {"regex": regex},
        **fields,
    }


def chat(server: RemoteServer, body: dict) -> dict:
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    return choice


def chat_stream(server: RemoteServer, body: dict) -> list[dict]:
    """Each chunk's choice (one choice per chunk here)."""
    with (
        server.http() as http,
        http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [choice for event in events[:-1] for choice in json.loads(event)["choices"]]


def joined(choices: list[dict]) -> dict:
    """The stream's deltas put together as a client does, with the finish reason."""
    message = {"reasoning_content": "", "content": "", "tool_calls": []}
    for choice in choices:
        delta = choice["delta"]
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        message["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                message["tool_calls"].append(dict(call["function"]))
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                message["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    message["finish_reason"] = [c["finish_reason"] for c in choices if c["finish_reason"]]
    return message


def test_reasoning_is_split_from_content_streamed_and_not(server):
    body = forced(THINK + "[a-z]{1,6}")
    choice = chat(server, body)
    message = choice["message"]
    assert re.fullmatch("[a-z ]{1,10}", message["reasoning_content"])
    assert re.fullmatch("[a-z]{1,6}", message["content"])
    assert message["tool_calls"] == [] and choice["finish_reason"] == "stop"
    choices = chat_stream(server, body)
    assert joined(choices) == {
        "reasoning_content": message["reasoning_content"],
        "content": message["content"],
        "tool_calls": [],
        "finish_reason": ["stop"],
    }
    # No delta carried a marker. How many deltas the reasoning took depends on how fast
    # this client read (a request's outputs merge while its reader lags, by design), so
    # that it streams as it comes is asserted on the stream handler alone, below.
    assert not any("think>" in json.dumps(c["delta"]) for c in choices)


def stream_token_by_token(tiny_tokenizer, text: str) -> list[dict]:
    """The chat stream handler's choices for `text` arriving one engine output per token
    (a client that keeps up), with reasoning and hermes tool parsers on, tool_choice auto."""
    chat = serving_chat(
        tiny_tokenizer,
        reasoning_parser="deepseek_r1",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    pieces = token_pieces(tiny_tokenizer, text)

    async def outputs() -> AsyncIterator[RequestOutput]:
        for n, piece in enumerate(pieces, start=1):
            finish = "stop" if n == len(pieces) else None
            completion = CompletionOutput(0, piece, [n], finish_reason=finish)
            yield RequestOutput("r", None, [1, 2], [completion], finished=finish is not None)

    async def events() -> list[str]:
        stream = chat._stream(
            ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER_TOOL], stream=True),
            SamplingParams(),
            "r",
            TINY_MODEL_NAME,
            outputs(),
            functools.partial(chat.parsing.new_message_parser, "auto", False),
        )
        return [event async for event in stream]

    sent = [event.removeprefix("data: ").strip() for event in asyncio.run(events())]
    assert sent[-1] == "[DONE]"
    return [choice for event in sent[:-1] for choice in json.loads(event)["choices"]]


def test_the_stream_sends_reasoning_and_arguments_as_each_output_comes(tiny_tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
    choices = stream_token_by_token(tiny_tokenizer, "<think>the user wants a city</think>" + call)
    assert joined(choices) == {
        "reasoning_content": "the user wants a city",
        "content": "",
        "tool_calls": [{"name": "get_weather", "arguments": '{"city": "paris"}'}],
        "finish_reason": ["tool_calls"],
    }
    reasoning_pieces = [c for c in choices if c["delta"].get("reasoning_content")]
    assert len(reasoning_pieces) > 3, reasoning_pieces
    argument_pieces = [c for c in choices if "tool_calls" in c["delta"]][1:]
    assert len(argument_pieces) > 3, argument_pieces
    assert not any("think>" in json.dumps(c["delta"]) for c in choices)


def test_auto_tool_call_after_the_reasoning_streamed_and_not(server):
    body = forced(THINK + CALL, tools=[WEATHER_TOOL])  # tool_choice "auto", the default
    choice = chat(server, body)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert re.fullmatch("[a-z ]{1,10}", message["reasoning_content"])
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    assert re.fullmatch("[a-z]{1,5}", json.loads(call["function"]["arguments"])["city"])
    choices = chat_stream(server, body)
    assert joined(choices) == {
        "reasoning_content": message["reasoning_content"],
        "content": "",
        "tool_calls": [call["function"]],
        "finish_reason": ["tool_calls"],
    }
    # In how many pieces the arguments came depends on this client's pace (see above).


def test_tool_choice_none_leaves_calls_in_the_content(server):
    choice = chat(server, forced(THINK + CALL, tools=[WEATHER_TOOL], tool_choice="none"))
    message = choice["message"]
    assert message["tool_calls"] == [] and choice["finish_reason"] == "stop"
    assert re.fullmatch(CALL, message["content"])
    assert message["reasoning_content"]


def test_a_prompt_that_closes_the_reasoning_leaves_all_content(server):
    body = forced(CALL, tools=[WEATHER_TOOL], chat_template=NO_THINKING_TEMPLATE)
    choice = chat(server, body)
    assert choice["message"]["reasoning_content"] is None
    assert choice["message"]["content"] is None
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_weather"]
    assert joined(chat_stream(server, body))["tool_calls"] == [
        call["function"] for call in choice["message"]["tool_calls"]
    ]
