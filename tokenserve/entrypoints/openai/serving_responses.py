"""POST /v1/responses (OpenAI's Responses API), and GET / DELETE / cancel of stored ones.

A Responses request runs as a chat request: its `instructions`, the stored conversation
of `previous_response_id` and its `input` become chat messages; `tools`, `tool_choice`,
`text.format`, `max_output_tokens`, `temperature` and `top_p` their chat counterparts. The
chat path then renders, checks and constrains it (OpenAIServingChat.prepare: the chat
template, tool-call parsers, forced tool-call formats, structured outputs, reasoning
parser), so both routes behave alike. Its output becomes output items
(responses_output.py); with `store` (the default) the response and its conversation are
kept in memory for later requests (response_store.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ValidationError

from tokenserve.entrypoints.openai.auth import TENANT_SALT_STATE
from tokenserve.entrypoints.openai.errors import OpenAIError, error_from_exception
from tokenserve.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaResponseFormat,
    NamedFunction,
    ResponseFormat,
    ToolCall,
    ToolChoice,
)
from tokenserve.entrypoints.openai.response_store import ResponseStore, StoredResponse
from tokenserve.entrypoints.openai.responses_output import ResponseEvents, item_id, output_items
from tokenserve.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    FunctionCallInput,
    FunctionCallItem,
    FunctionCallOutputInput,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    MessageItem,
    NamedFunctionChoice,
    OutputItem,
    OutputTokensDetails,
    ReasoningInput,
    ReasoningItem,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from tokenserve.entrypoints.openai.serving_base import EventStream, collect_final_outputs
from tokenserve.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat
from tokenserve.outputs import RequestOutput

_INPUT_ITEMS: dict[str, type[BaseModel]] = {
    "message": InputMessage,
    "function_call": FunctionCallInput,
    "function_call_output": FunctionCallOutputInput,
    "reasoning": ReasoningInput,
}
# A chat parameter's name in a Responses request, for the errors the chat path raises.
_PARAMS = {"response_format": "text", "max_tokens": "max_output_tokens", "messages": "input"}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    async def create_response(
        self, request: ResponsesRequest, raw_request: HTTPRequest
    ) -> ResponseObject | EventStream:
        if request.background:
            raise OpenAIError(
                400, "background responses are not supported by this server.", param="background"
            )
        owner = _owner(raw_request)
        history: list[ChatMessage] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id, owner)
            if previous is None:
                raise OpenAIError(
                    404,
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = previous.messages
        conversation = [*history, *input_messages(request.input)]
        instructions = (
            [ChatMessage(role="system", content=request.instructions)]
            if request.instructions
            else []
        )
        try:
            prepared = self.chat.prepare(chat_request(request, [*instructions, *conversation]))
        except OpenAIError as error:
            error.param = _PARAMS.get(error.param or "", error.param)
            raise
        response_id = item_id("resp")
        [outputs] = await self.chat.add_requests(
            response_id,
            [(prepared.text, prepared.token_ids)],
            prepared.params,
            request.priority,
            request.cache_salt,
            self.chat.lora_request_for(prepared.model_name),
        )
        shell = _response_shell(request, response_id, prepared.model_name)
        if request.stream:
            events = self._stream(request, shell, prepared, outputs, conversation, owner)
            return EventStream(events, [outputs])
        [final] = await collect_final_outputs([outputs], raw_request)
        [output] = final.outputs
        incomplete = output.finish_reason == "length"
        message = prepared.new_parser().parse(output.text)
        items = output_items(message, incomplete)
        response = _finished(shell, items, final, output.token_ids, self._reasoning_tokens)
        self._keep(request, response, conversation, owner)
        return response

    def _reasoning_tokens(self, token_ids: list[int], items: list[OutputItem]) -> int:
        """Output tokens up to and including the reasoning's end marker (all of them when
        it never came); 0 without a reasoning item."""
        reasoning_class = self.chat.parsing.reasoning_parser_class
        if reasoning_class is None or not any(isinstance(i, ReasoningItem) for i in items):
            return 0
        return count_tokens_through(self.chat.tokenizer, token_ids, reasoning_class.end_marker)

    def retrieve(self, response_id: str, raw_request: HTTPRequest) -> ResponseObject:
        return self._stored(response_id, raw_request).response

    def delete(self, response_id: str, raw_request: HTTPRequest) -> DeletedResponse:
        if not self.store.delete(response_id, _owner(raw_request)):
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    def cancel(self, response_id: str, raw_request: HTTPRequest) -> ResponseObject:
        self._stored(response_id, raw_request)
        # Every response here ran in the foreground and has ended (OpenAI's answer).
        raise OpenAIError(400, "Only responses created with background=true can be cancelled.")

    def _stored(self, response_id: str, raw_request: HTTPRequest) -> StoredResponse:
        stored = self.store.get(response_id, _owner(raw_request))
        if stored is None:
            raise _not_found(response_id)
        return stored

    def _keep(
        self,
        request: ResponsesRequest,
        response: ResponseObject,
        conversation: list[ChatMessage],
        owner: str | None,
    ) -> None:
        if request.store:
            messages = [*conversation, assistant_turn(response.output)]
            self.store.put(StoredResponse(response, messages, owner))

    async def _stream(
        self,
        request: ResponsesRequest,
        shell: ResponseObject,
        prepared: PreparedChat,
        outputs: AsyncIterator[RequestOutput],
        conversation: list[ChatMessage],
        owner: str | None,
    ) -> AsyncGenerator[str, None]:
        events = ResponseEvents()
        parser = prepared.new_parser()
        yield events.event("response.created", response=shell.model_dump())
        yield events.event("response.in_progress", response=shell.model_dump())
        last: RequestOutput | None = None
        token_ids: list[int] = []
        finish_reason = None
        try:
            async for result in outputs:
                last = result
                for output in result.outputs:
                    token_ids += output.token_ids
                    deltas = parser.feed(output.text)
                    if output.finished:
                        deltas.extend(parser.finish())
                        finish_reason = output.finish_reason
                    for delta in deltas:
                        for event in events.feed(delta):
                            yield event
            incomplete = finish_reason == "length"
            for event in events.finish(incomplete):
                yield event
            assert last is not None  # a request's stream ends with its finished output
            response = _finished(shell, events.items, last, token_ids, self._reasoning_tokens)
            self._keep(request, response, conversation, owner)
            done = "response.incomplete" if incomplete else "response.completed"
            yield events.event(done, response=response.model_dump())
        except Exception as exception:  # noqa: BLE001 - the status is sent; the error goes in the stream
            error = error_from_exception(exception)
            yield events.event("error", code=error.code, message=error.message, param=error.param)


def input_messages(input_: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """A request's `input` as chat messages: text is one user message; items map one by
    one (calls join the assistant turn before them; reasoning items are left out)."""
    if isinstance(input_, str):
        return [ChatMessage(role="user", content=input_)]
    if not input_:
        raise OpenAIError(400, "input must not be empty.", param="input")
    messages: list[ChatMessage] = []
    for index, raw in enumerate(input_):
        item = _input_item(index, raw)
        if isinstance(item, InputMessage):
            # Chat templates know "system"; OpenAI's "developer" plays that part.
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=item.text))
        elif isinstance(item, FunctionCallInput):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputInput):
            messages.append(
                ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output)
            )
    if not messages:
        raise OpenAIError(400, "input holds no message.", param="input")
    return messages


def _input_item(index: int, raw: dict[str, Any]) -> BaseModel:
    kind = raw.get("type", "message")  # a bare {"role", "content"} is a message
    model = _INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise OpenAIError(
            400,
            f"input[{index}]: items of type {kind!r} are not supported; use "
            f"{', '.join(_INPUT_ITEMS)}.",
            param="input",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        details = "; ".join(
            f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise OpenAIError(400, f"input[{index}]: {details}", param="input") from None


def chat_request(request: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that runs a Responses request."""
    tools = None
    if request.tools is not None:
        tools = []
        for tool in request.tools:
            if tool.type != "function" or not tool.name:
                raise OpenAIError(
                    400,
                    f"Only function tools with a name are supported, got type {tool.type!r}.",
                    param="tools",
                )
            function = FunctionDefinition(
                name=tool.name,
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            )
            tools.append(ChatCompletionToolsParam(function=function))
    tool_choice: ToolChoice | None
    if isinstance(request.tool_choice, NamedFunctionChoice):
        function = NamedFunction(name=request.tool_choice.name)
        tool_choice = ChatCompletionNamedToolChoiceParam(function=function)
    else:
        tool_choice = request.tool_choice
    response_format = None
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise OpenAIError(400, 'text.format of type "json_schema" needs schema.', param="text")
        json_schema = JsonSchemaResponseFormat(name=text_format.name, schema=text_format.schema_)
        response_format = ResponseFormat(type="json_schema", json_schema=json_schema)
    elif text_format is not None and text_format.type == "json_object":
        response_format = ResponseFormat(type="json_object")
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=response_format,
        stream=request.stream,
        cache_salt=request.cache_salt,
        priority=request.priority,
    )


def assistant_turn(items: list[OutputItem]) -> ChatMessage:
    """A response's output as the assistant message a later turn sees (no reasoning)."""
    text = "".join(
        part.text for item in items if isinstance(item, MessageItem) for part in item.content
    )
    calls = [
        ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
        for item in items
        if isinstance(item, FunctionCallItem)
    ]
    return ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)


def _response_shell(request: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The response before any output: the request's settings, status in_progress."""
    tool_choice = request.tool_choice or ("auto" if request.tools else "none")
    return ResponseObject(
        id=response_id,
        status="in_progress",
        model=model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
        tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        parallel_tool_calls=request.parallel_tool_calls,
        previous_response_id=request.previous_response_id,
        text=(request.text.model_dump(by_alias=True, exclude_none=True) if request.text else None)
        or {"format": {"type": "text"}},
        reasoning=request.reasoning,
        store=request.store,
        metadata=request.metadata or {},
        user=request.user,
    )


def count_tokens_through(tokenizer: Any, token_ids: list[int], marker: str) -> int:
    """How many of `token_ids` it takes for their text to hold `marker` (all if never)."""
    if marker not in tokenizer.decode(token_ids):
        return len(token_ids)
    low, high = 1, len(token_ids)  # a prefix holding the marker: its extensions hold it too
    while low < high:
        middle = (low + high) // 2
        if marker in tokenizer.decode(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


def _finished(
    shell: ResponseObject,
    items: list[OutputItem],
    final: RequestOutput,
    token_ids: list[int],
    reasoning_tokens: Callable[[list[int], list[OutputItem]], int],
) -> ResponseObject:
    incomplete = bool(final.outputs) and final.outputs[0].finish_reason == "length"
    num_input_tokens = len(final.prompt_token_ids)
    usage = ResponseUsage(
        input_tokens=num_input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
        output_tokens=len(token_ids),
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=reasoning_tokens(token_ids, items)
        ),
        total_tokens=num_input_tokens + len(token_ids),
    )
    return shell.model_copy(
        update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
            "output": items,
            "usage": usage,
        }
    )


def _owner(raw_request: HTTPRequest) -> str | None:
    """The API key's tenant (set by auth.py), or None without keys."""
    return raw_request.scope.get("state", {}).get(TENANT_SALT_STATE)


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id")
