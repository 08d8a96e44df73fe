"""--tool-call-parser hermes and --reasoning-parser deepseek_r1 over HTTP, on a tiny model
driven by structured outputs to write `<think>...</think>` and `<tool_call>...</tool_call>`
(the server constrains the reasoning too: --structured-outputs-config.enable_in_reasoning)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME, RemoteServer

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
    # The reasoning streamed as it came, and no delta carried a marker.
    assert sum(1 for c in choices if c["delta"].get("reasoning_content")) > 1
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
    argument_pieces = [c for c in choices if "tool_calls" in c["delta"]][1:]
    assert len(argument_pieces) > 1  # the arguments streamed, not in one piece at the end


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
