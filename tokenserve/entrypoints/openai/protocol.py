"""The OpenAI API's request and response bodies, as pydantic models.

Field names and defaults follow OpenAI's API; vLLM's extra sampling fields (top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, cache_salt, priority, ...) are
accepted too. Requests turn themselves into SamplingParams; SamplingParams validates.
Two checks happen here because nothing later could make them: integers fit in 64 bits (the
engine core's wire format), and text is valid Unicode (JSON's `\\ud800` escapes can carry
lone surrogates, which no tokenizer or response can encode).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from tokenserve.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_seconds() -> int:
    return int(time.time())


# Integers a request may carry: the engine core's wire format (msgpack) holds 64 bits.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=2**63 - 1)]
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")


class RequestBody(OpenAIModel):
    """A request's whole body; all of its text, however nested, must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        pending = [data]
        while pending:
            item = pending.pop()
            if isinstance(item, str):
                if _LONE_SURROGATE.search(item):
                    raise ValueError(
                        "Text must be valid Unicode; lone surrogates such as \\ud800 are refused."
                    )
            elif isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
        return data


# ---- errors, usage, models ----------------------------------------------------------


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    # vLLM's extension: usage on every chunk, not only on the last one.
    continuous_usage_stats: bool = False


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_seconds)
    owned_by: str = "tokenserve"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for a base model.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_int_id: int | None = None


# ---- structured outputs --------------------------------------------------------------


class JsonSchemaResponseFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar is always strict


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs` request field: exactly one of json / json_object / regex /
    choice / grammar. Unknown keys are refused, so a misspelt one is not silently ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # `json` would shadow pydantic's BaseModel.json.
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


# ---- sampling fields shared by /v1/completions and /v1/chat/completions --------------


class SamplingRequest(RequestBody):
    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: NonNegativeInt64 | None = None
    cache_salt: str | None = None
    priority: Int64 = 0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's
    # older guided_* fields (tokenserve/entrypoints/openai/structured_outputs.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # KV connectors (P/D, vLLM's field): {"do_remote_decode": true} asks a prefill instance
    # to keep the KV for a decode instance; the response's kv_transfer_params say where.
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        return self

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams for this request; raises ValueError for invalid values."""
        optional: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            # JSON keys are strings; SamplingParams turns them into token ids (or refuses).
            logit_bias=cast(Any, self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs,
            extra_args=None
            if self.kv_transfer_params is None
            else {"kv_transfer_params": self.kv_transfer_params},
            **{name: value for name, value in optional.items() if value is not None},
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )


# ---- /v1/completions ----------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int64 | None = 16
    logprobs: NonNegativeInt64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's extension: the stop string or token id that ended the sample.
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # With a KV connector (P/D, vLLM's field): where a decode instance finds the KV.
    kv_transfer_params: dict[str, Any] | None = None


# ---- /v1/chat/completions -----------------------------------------------------------


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # other fields reach the template as they are

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: NonNegativeInt64 | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    # Default: "auto" with tools, "none" without (OpenAI's).
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat-template fields.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatLogProb(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's field, with --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    # With a KV connector (P/D, vLLM's field): where a decode instance finds the KV.
    kv_transfer_params: dict[str, Any] | None = None


class DeltaModel(OpenAIModel):
    @model_serializer(mode="wrap")
    def _omit_unset_fields(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed: {"role": ...} first, then {"content": ...}.
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(DeltaModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(DeltaModel):
    """A call's first delta has its id, type and name (arguments ""); later ones only the
    index and the next piece of the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(DeltaModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- /tokenize and /detokenize ------------------------------------------------------


class TokenizeRequest(RequestBody):
    """Either `prompt` (a completion prompt) or `messages` (a chat, rendered first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatCompletionToolsParam] | None = None  # rendered by the chat template
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
