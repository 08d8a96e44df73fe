"""Chat templates: load an override, render a conversation into prompt text and its images.

Rendering goes through the tokenizer's `apply_chat_template`, i.e. transformers' jinja2
environment, so a model's template renders here exactly as it does in transformers. Tools
and earlier tool calls (their arguments as objects) reach the template too.
Content parts are given to the template in its content format (`--chat-template-content-format`,
detected from the template as vLLM does): "string" templates get each message's text parts
joined, with the model's image placeholder per image; "openai" templates iterate over the
parts themselves and get `{"type": "image"}` parts in place. Images come back as their URLs
(or PIL images, offline), in prompt order, for the caller to fetch (multimodal/media.py).
Anything wrong with the conversation or the template is a ValueError (HTTP 400).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jinja2
import jinja2.nodes

ContentFormat = Literal["string", "openai"]
CONTENT_FORMAT_OPTIONS = ("auto", "string", "openai")  # --chat-template-content-format
DEFAULT_IMAGE_PLACEHOLDER = "<image>"
# A URL (str) to fetch, or, offline, an image given as a PIL image ("image_pil" parts).
ImageInput = Any


@dataclass(frozen=True)
class ChatContentConfig:
    """How content parts reach the template: its content format ("auto": detected), the
    model's image placeholder for "string" templates, and the most images in one prompt
    (refused before anything is fetched)."""

    content_format: str = "auto"
    image_placeholder: str = DEFAULT_IMAGE_PLACEHOLDER
    max_images_per_prompt: int | None = None

    def __post_init__(self) -> None:
        if self.content_format not in CONTENT_FORMAT_OPTIONS:
            raise ValueError(
                f"chat template content format must be one of {', '.join(CONTENT_FORMAT_OPTIONS)}, "
                f"got {self.content_format!r}."
            )
        if self.max_images_per_prompt is not None and self.max_images_per_prompt < 0:
            raise ValueError(
                f"max_images_per_prompt must be non-negative, got {self.max_images_per_prompt}."
            )


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: the prompt text and its images in prompt order."""

    text: str
    images: list[ImageInput] = field(default_factory=list)


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
    content: ChatContentConfig | None = None,
) -> str:
    """The conversation as prompt text, rendered with `chat_template` or the model's own;
    a conversation with images is refused (only `render_chat_prompt` hands them on)."""
    prompt = render_chat_prompt(
        tokenizer, messages, chat_template, add_generation_prompt, continue_final_message,
        chat_template_kwargs, tools, content,
    )
    if prompt.images:
        raise ValueError("Image content parts are accepted by chat completions only.")
    return prompt.text


def render_chat_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    content: ChatContentConfig | None = None,
) -> ChatPrompt:
    """The conversation as prompt text and the images its content parts name, in order."""
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
    content = content or ChatContentConfig()
    content_format = resolve_content_format(
        content.content_format, tokenizer, chat_template, tools
    )
    images: list[ImageInput] = []
    template_messages = [
        _template_message(message, content_format, content.image_placeholder, images)
        for message in messages
    ]
    limit = content.max_images_per_prompt
    if limit is not None and len(images) > limit:
        raise ValueError(
            f"At most {limit} image(s) may be given in one prompt, got {len(images)}."
        )
    try:
        text = tokenizer.apply_chat_template(
            template_messages,
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except (jinja2.TemplateError, TypeError, KeyError, IndexError) as error:
        raise ValueError(f"The chat template could not render these messages: {error}") from None
    return ChatPrompt(text, images)


def resolve_content_format(
    option: str, tokenizer: Any, chat_template: str | None, tools: list | None = None
) -> ContentFormat:
    """The content format a template gets: the option, or with "auto" the detected one."""
    if option == "string" or option == "openai":
        return option
    try:
        template = tokenizer.get_chat_template(chat_template, tools)
    except (ValueError, TypeError, AttributeError):
        return "string"
    return detect_content_format(template)


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """"openai" when the template loops over a message's content (it expects a list of
    parts), else "string"; a template that does not parse is taken as "string"."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
    except (ImportError, jinja2.TemplateError):
        environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = environment.parse(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if _loops_over_content(tree) else "string"


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    """Whether a `for` iterates over `message['content']` (or `.content`) of a message taken
    from `messages`, following `set` renames (`loop_messages = messages[1:]`, ...)."""
    lists, items, contents = {"messages"}, set(), set()
    assigns = list(tree.find_all(jinja2.nodes.Assign))
    loops = list(tree.find_all(jinja2.nodes.For))

    def is_content(node: jinja2.nodes.Node) -> bool:
        node = _unwrap(node)
        if isinstance(node, jinja2.nodes.Name):
            return node.name in contents
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == "content" and _name(node.node) in items
        if isinstance(node, jinja2.nodes.Getitem):
            arg = node.arg
            return (
                isinstance(arg, jinja2.nodes.Const) and arg.value == "content"
                and _name(node.node) in items
            )
        return False

    for _ in range(4):  # renames of renames, a few levels deep
        for assign in assigns:
            target = _name(assign.target)
            if target is None:
                continue
            value = _unwrap(assign.node)
            if _name(value) in lists or (
                isinstance(value, jinja2.nodes.Getitem)
                and isinstance(value.arg, jinja2.nodes.Slice)
                and _name(value.node) in lists
            ):
                lists.add(target)
            elif isinstance(value, jinja2.nodes.Getitem) and _name(value.node) in lists:
                items.add(target)
            elif is_content(value):
                contents.add(target)
        for loop in loops:
            target = _name(loop.target)
            if target is not None and _name(_unwrap(loop.iter)) in lists:
                items.add(target)
    return any(is_content(loop.iter) for loop in loops)


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """A filtered or sliced expression's base (`x | selectattr(...)` → `x`)."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    return node


def _name(node: jinja2.nodes.Node | None) -> str | None:
    return node.name if isinstance(node, jinja2.nodes.Name) else None


def _template_message(
    message: Mapping[str, Any],
    content_format: ContentFormat,
    image_placeholder: str,
    images: list[ImageInput],
) -> dict[str, Any]:
    """The message as the template gets it; its images are appended to `images`."""
    plain = {key: value for key, value in message.items() if value is not None}
    content = message.get("content")
    if isinstance(content, list):
        texts: list[str] = []
        parts: list[dict[str, Any]] = []
        num_images = 0
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind == "text":
                texts.append(str(part.get("text", "")))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind in ("image_url", "image_pil"):
                images.append(_image_input(part, kind))
                parts.append({"type": "image"})
                num_images += 1
            else:
                raise ValueError(
                    f"Content part type {kind!r} is not supported; use text or image_url."
                )
        plain["content"] = (
            parts
            if content_format == "openai"
            else _with_placeholders("\n".join(texts), num_images, image_placeholder)
        )
    elif content is None:
        plain["content"] = [] if content_format == "openai" else ""
    elif content_format == "openai" and isinstance(content, str):
        plain["content"] = [{"type": "text", "text": content}]
    if isinstance(message.get("tool_calls"), list):
        plain["tool_calls"] = [_template_tool_call(call) for call in message["tool_calls"]]
    return plain


def _image_input(part: Mapping[str, Any], kind: str) -> ImageInput:
    """An image part's URL (`image_url`: `{"url": ...}` or the URL itself) or PIL image."""
    value = part.get(kind)
    if kind == "image_pil":
        from PIL import Image

        if not isinstance(value, Image.Image):
            raise ValueError("An image_pil content part must hold a PIL image (offline only).")
        return value
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise ValueError('An image_url content part needs {"image_url": {"url": "..."}}.')
    return url


def _with_placeholders(text: str, num_images: int, placeholder: str) -> str:
    """A "string" template's content: placeholders the text lacks go first, one line each
    (placeholders the user wrote count), as vLLM does."""
    if num_images == 0:
        return text
    missing = num_images - text.count(placeholder)
    if missing < 0:
        raise ValueError(
            f"The message has more {placeholder!r} placeholders than images ({num_images})."
        )
    return "\n".join([placeholder] * missing + [text])


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
