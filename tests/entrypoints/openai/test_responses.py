"""POST /v1/responses with the official `openai` client against `tokenserve serve`: plain,
streamed, with a tool, with a JSON schema, chained by previous_response_id, the stored
responses' routes, reasoning items, and the errors. A Responses request runs as the
equivalent chat request, so greedy outputs are compared with /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.remote_server import TINY_MODEL_NAME, RemoteServer
from tests.entrypoints.openai.test_errors import assert_error

GREEDY = {"model": TINY_MODEL_NAME, "temperature": 0.0}
QUESTION = "What is the weather like in Paris?"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
# Events of a stream that writes one message, in order (deltas collapsed).
MESSAGE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def chat_content(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str | None:
    completion = client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)
    return completion.choices[0].message.content


def event_kinds(events) -> list[str]:
    kinds: list[str] = []
    for event in events:
        if not (kinds and kinds[-1] == event.type and event.type.endswith(".delta")):
            kinds.append(event.type)
    return kinds


def test_plain_text_input_with_instructions(tiny_client):
    response = tiny_client.responses.create(
        input=QUESTION, instructions="Answer briefly.", max_output_tokens=12, **GREEDY
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete" and message.id.startswith("msg_")
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": QUESTION},
    ]
    assert response.output_text == chat_content(tiny_client, messages, 12)
    usage = response.usage
    assert usage.output_tokens == 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 12


def test_streamed_events_add_up_to_the_response(tiny_client):
    request = {"input": [{"role": "user", "content": QUESTION}], "max_output_tokens": 10}
    whole = tiny_client.responses.create(**request, **GREEDY)
    events = list(tiny_client.responses.create(**request, stream=True, **GREEDY))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert event_kinds(events) == [*MESSAGE_EVENTS, "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "incomplete" and final.usage.output_tokens == 10
    # The stored response is the streamed one.
    assert tiny_client.responses.retrieve(final.id).output_text == deltas


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "name": "get_weather"}, "required"],
    ids=["named", "required"],
)
def test_forced_tool_call(tiny_client, tool_choice):
    request = {
        "input": QUESTION,
        "tools": [WEATHER_TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_output_tokens": 80,
        **GREEDY,
    }
    response = tiny_client.responses.create(**request)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    # strict=False: the random model writes raw control characters into strings.
    jsonschema.validate(json.loads(call.arguments, strict=False), WEATHER)
    assert response.status == "completed"
    assert response.tool_choice == tool_choice or response.tool_choice.name == "get_weather"
    events = list(tiny_client.responses.create(**request, stream=True))
    assert event_kinds(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == call.arguments == events[-1].response.output[0].arguments


def test_json_schema_text_format(default_server):
    # The default model: a random one pads JSON with whitespace up to max_output_tokens.
    response = default_server.client().responses.create(
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
        max_output_tokens=60,
        temperature=0.0,
    )
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(tiny_server, tiny_client):
    first = tiny_client.responses.create(input="Hello there.", max_output_tokens=5, **GREEDY)
    second = tiny_client.responses.create(
        input="And then?", previous_response_id=first.id, max_output_tokens=5, **GREEDY
    )
    assert second.previous_response_id == first.id
    conversation = [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    with tiny_server.http() as http:
        tokens = http.post("/tokenize", json={"messages": conversation}).json()["tokens"]
    assert second.usage.input_tokens == len(tokens)
    assert second.output_text == chat_content(tiny_client, conversation, 5)
    # Not stored: it can be neither retrieved nor continued.
    unstored = tiny_client.responses.create(input="Hi", store=False, max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        tiny_client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as caught:
        tiny_client.responses.create(input="x", previous_response_id=unstored.id, **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"


def test_function_call_output_items_reach_the_template(tiny_server, tiny_client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}  # fmt: skip
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
    ]
    response = tiny_client.responses.create(input=items, max_output_tokens=4, **GREEDY)
    conversation = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]
    with tiny_server.http() as http:
        tokens = http.post("/tokenize", json={"messages": conversation}).json()["tokens"]
    assert response.usage.input_tokens == len(tokens)


def test_stored_response_routes(tiny_server, tiny_client):
    response = tiny_client.responses.create(input="Hi", max_output_tokens=3, **GREEDY)
    assert tiny_client.responses.retrieve(response.id).output_text == response.output_text
    with tiny_server.http() as http:
        assert_error(http.post(f"/v1/responses/{response.id}/cancel"), 400)
        assert http.delete(f"/v1/responses/{response.id}").json()["deleted"] is True
        assert_error(http.get(f"/v1/responses/{response.id}"), 404)
        assert_error(http.delete(f"/v1/responses/{response.id}"), 404)
        assert_error(http.post("/v1/responses/resp_unknown/cancel"), 404)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input"),
        ({"input": "hi", "model": "gpt-5"}, 404, "model"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "hi", "tool_choice": "required"}, 400, "tools"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
        ({"input": "hi", "max_output_tokens": 5000}, 400, "max_output_tokens"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"instructions": "no input"}, 400, "input"),
    ],
)
def test_errors_are_openai_shaped(tiny_server, body, status, param):
    with tiny_server.http() as http:
        error = assert_error(http.post("/v1/responses", json=body), status)
    assert error["param"] == param, error


def test_the_server_keeps_serving_after_errors(tiny_client):
    with pytest.raises(openai.BadRequestError):
        tiny_client.responses.create(input=[], **GREEDY)
    assert tiny_client.responses.create(input="Hi", max_output_tokens=2, **GREEDY).output


# ---- with --reasoning-parser: reasoning output items ----------------------------------


@pytest.fixture(scope="module")
def reasoning_server(tiny_model_dirs: dict[str, str]) -> Iterator[RemoteServer]:
    # deepseek_r1 reads everything before `</think>` as reasoning: a random model's output
    # is all reasoning.
    server = RemoteServer(
        tiny_model_dirs["llama"], "--served-model-name", TINY_MODEL_NAME,
        "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--reasoning-parser",
        "deepseek_r1",
    )  # fmt: skip
    yield server
    server.stop()


def test_reasoning_items(reasoning_server):
    client = reasoning_server.client()
    response = client.responses.create(input=QUESTION, max_output_tokens=8, **GREEDY)
    [reasoning] = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": QUESTION}], max_tokens=8, **GREEDY
    ).choices[0]
    expected = chat.message.model_extra["reasoning_content"]
    assert expected and reasoning.content[0].text == expected
    # No `</think>` came: every output token was reasoning.
    assert response.usage.output_tokens_details.reasoning_tokens == 8
    events = list(
        client.responses.create(input=QUESTION, max_output_tokens=8, stream=True, **GREEDY)
    )
    assert event_kinds(events)[2:6] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == expected == events[-1].response.output[0].content[0].text
