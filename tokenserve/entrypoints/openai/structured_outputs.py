"""What constrains a request's output: its request fields → StructuredOutputsParams.

A request may ask through one of OpenAI's `response_format` (`json_object`, `json_schema`),
vLLM's `structured_outputs` field, or vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`; a chat may also force tool calls (`tool_choice`
"required" or a named function: tool_parsers/forced.py). At most one of these per request.
The spec is compiled here (without the vocabulary, cached) so that a bad schema, regex or
grammar is a 400 naming the field, before anything reaches the engine.

With a reasoning parser, the grammar starts after the reasoning (`enforce_after_token_ids`
= the end marker's token ids), unless the prompt already closed the reasoning or the
server constrains the reasoning too (`--structured-outputs-config.enable_in_reasoning`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenserve.entrypoints.openai.errors import OpenAIError
from tokenserve.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    SamplingRequest,
    ToolChoice,
)
from tokenserve.entrypoints.openai.tool_parsers.forced import (
    parameters_schema,
    required_calls_schema,
)
from tokenserve.sampling_params import StructuredOutputsParams

_GUIDED_KINDS = ("json", "regex", "choice", "grammar")


def requested_structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The constraint the request's own fields ask for; 400 if invalid or more than one."""
    asked: list[tuple[str, dict[str, Any]]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        schema = response_format.json_schema and response_format.json_schema.schema_
        if schema is None:
            raise OpenAIError(
                400,
                'response_format of type "json_schema" needs json_schema.schema.',
                param="response_format",
            )
        asked.append(("response_format", {"json": schema}))
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        asked.append(("structured_outputs", fields))
    guided = {
        kind: value
        for kind in _GUIDED_KINDS
        if (value := getattr(request, f"guided_{kind}")) is not None
    }
    if guided:
        asked.append((f"guided_{next(iter(guided))}", guided))
    if len(asked) > 1:
        raise OpenAIError(
            400,
            "Give at most one of response_format, structured_outputs and guided_*; got "
            f"{', '.join(param for param, _ in asked)}.",
            param=asked[1][0],
        )
    if not asked:
        return None
    param, fields = asked[0]
    return checked(param, fields)


def tool_choice_structured_outputs(
    tools: list[ChatCompletionToolsParam],
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
) -> StructuredOutputsParams | None:
    """The schema that forces "required" or named tool calls; None for "none" / "auto"."""
    # Compact JSON: calls are read by programs, and a small model cannot pad them with
    # whitespace until max_tokens.
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        # The serving layer has checked that the name is one of the tools.
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        schema = parameters_schema(tool.function.parameters)
    elif tool_choice == "required":
        functions = [(tool.function.name, tool.function.parameters) for tool in tools]
        schema = required_calls_schema(functions, parallel_tool_calls)
    else:
        return None
    return checked("tools", {"json": schema, "disable_any_whitespace": True})


def after_reasoning(
    structured: StructuredOutputsParams, end_token_ids: list[int]
) -> StructuredOutputsParams:
    """The same constraint, applied only once the reasoning's end marker has been generated."""
    return dataclasses.replace(structured, enforce_after_token_ids=list(end_token_ids))


def checked(param: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams(**fields), compiled once; 400 naming `param` if invalid."""
    # Imported late: xgrammar loads only once a request asks for structured outputs.
    from tokenserve.structured_output.grammar import check_structured_outputs

    try:
        structured = StructuredOutputsParams(**fields)
        check_structured_outputs(structured)
    except ValueError as error:
        raise OpenAIError(400, str(error), param=param) from None
    return structured
