"""The OpenAI Responses API's bodies (`POST /v1/responses`), as pydantic models.

A request carries its conversation as `input` (a string, or a list of items: messages,
earlier function calls and their outputs) plus `instructions`; the response is a list of
output items (`reasoning`, `message`, `function_call`) with a status and usage. Field
names and defaults follow OpenAI's API; fields this server cannot honour are refused
where they are read (serving_responses.py), never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from tokenserve.entrypoints.openai.protocol import (
    Int64,
    OpenAIModel,
    RequestBody,
    now_seconds,
)

# ---- the request -------------------------------------------------------------------


class InputText(OpenAIModel):
    """A text part of an input message (`input_text`, or `output_text` in an assistant's)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallInput(OpenAIModel):
    """An earlier call of the model's, given back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputInput(OpenAIModel):
    """What the client's function returned for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningInput(OpenAIModel):
    """An earlier reasoning item: accepted, not shown to the model again (as chat templates
    drop earlier turns' reasoning)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallInput | FunctionCallOutputInput | ReasoningInput


class FunctionTool(OpenAIModel):
    """A function tool; the Responses shape is flat (no nested `function`)."""

    type: str  # only "function" is served; others are refused with a 400 naming them
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Literal["none", "auto", "required"] | NamedFunctionChoice


class TextFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    reasoning: dict[str, Any] | None = None  # echoed; the model reasons as it was trained to
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    # vLLM's extras, as on the other routes.
    seed: Int64 | None = None
    top_k: Int64 | None = None
    cache_salt: str | None = None
    priority: Int64 = 0


# ---- the response ------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now_seconds)
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's settings, echoed.
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None


class DeletedResponse(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
