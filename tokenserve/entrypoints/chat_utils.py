"""Chat templates: load an override, render a conversation into prompt text.

Rendering goes through the tokenizer's `apply_chat_template`, i.e. transformers' jinja2
environment, so a model's template renders here exactly as it does in transformers. Tools
and earlier tool calls (their arguments as objects) reach the template too.
Anything wrong with the conversation or the template is a ValueError (HTTP 400).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2


def load_chat_template(value: str | None) -> str | None:
    """A template from a file path or given inline (jinja2 text); None keeps the model's."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"Chat template {value!r} is neither a file nor a jinja2 template.")


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as prompt text, rendered with `chat_template` or the model's own."""
    if not messages:
        raise ValueError("messages must contain at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message needs the last message to be the assistant's.")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "This model has no chat template; start the server with --chat-template or pass "
            "chat_template in the request."
        )
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"conversation", "messages", "tokenize", "chat_template", "tools"} & set(kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}.")
    try:
        return tokenizer.apply_chat_template(
            [_plain_message(message) for message in messages],
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except (jinja2.TemplateError, TypeError, KeyError, IndexError) as error:
        raise ValueError(f"The chat template could not render these messages: {error}") from None


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message with list-of-parts content joined into one string (text parts only)."""
    plain = {key: value for key, value in message.items() if value is not None}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"Only text content parts are supported, got {kind!r}.")
            texts.append(str(part.get("text", "")))
        plain["content"] = "\n".join(texts)
    elif content is None:
        plain["content"] = ""
    if isinstance(message.get("tool_calls"), list):
        plain["tool_calls"] = [_template_tool_call(call) for call in message["tool_calls"]]
    return plain


def _template_tool_call(call: Any) -> Any:
    """An assistant's earlier call with its arguments as a dict: OpenAI sends them as JSON
    text, chat templates (`tool_call.arguments | tojson`) expect the object (as vLLM does)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
