"""The assistant's message as Responses output items, whole or as a stream of events.

Reasoning becomes a `reasoning` item, content a `message` item with one `output_text`
part, each tool call a `function_call` item, in that order. Streamed, the message
parser's deltas (assistant_message.py) open and close items as they change kind:
`response.output_item.added`, `response.content_part.added`, the text or argument deltas,
their `.done` events, `response.content_part.done`, `response.output_item.done`. Every event
carries the next `sequence_number`. An output cut by max_output_tokens leaves its last
item "incomplete", whole or streamed.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tokenserve.entrypoints.openai.assistant_message import AssistantMessage
from tokenserve.entrypoints.openai.protocol import DeltaMessage
from tokenserve.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
)


def item_id(prefix: str) -> str:
    """OpenAI's id shape: `resp_...`, `msg_...`, `fc_...`, `call_...`, `rs_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: AssistantMessage, incomplete: bool) -> list[OutputItem]:
    """A whole output's items."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(
            ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=message.reasoning_content)])
        )
    if message.content:
        items.append(MessageItem(id=item_id("msg"), content=[OutputText(text=message.content)]))
    for call in message.tool_calls:
        items.append(
            FunctionCallItem(
                id=item_id("fc"), call_id=item_id("call"), name=call.name, arguments=call.arguments
            )
        )
    if incomplete and items:
        items[-1].status = "incomplete"
    return items


class ResponseEvents:
    """One response's stream: events out, and the output items they add up to."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None

    def event(self, event_type: str, **fields: Any) -> str:
        """One server-sent event, named by its type, with the next sequence number."""
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        # ASCII JSON: no raw character a line reader could take for a line break.
        return f"event: {event_type}\ndata: {json.dumps(payload)}\n\n"

    def feed(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.reasoning_content:
            events += self._text(ReasoningItem, delta.reasoning_content)
        if delta.content:
            events += self._text(MessageItem, delta.content)
        for call in delta.tool_calls or []:
            arguments = call.function.arguments if call.function else None
            if call.id is not None:  # a new call: its name, arguments to come
                name = call.function.name if call.function else None
                events += self._close("completed")
                item = FunctionCallItem(
                    id=item_id("fc"),
                    call_id=item_id("call"),
                    name=name or "",
                    arguments="",
                    status="in_progress",
                )
                events += self._add(item)
            if arguments and isinstance(self._open, FunctionCallItem):
                self._open.arguments += arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self._open.id,
                        output_index=len(self.items) - 1,
                        delta=arguments,
                    )
                )
        return events

    def finish(self, incomplete: bool) -> list[str]:
        """The output has ended: the open item is done (incomplete if the output was cut)."""
        return self._close("incomplete" if incomplete else "completed")

    def _text(self, kind: type[MessageItem | ReasoningItem], text: str) -> list[str]:
        events: list[str] = []
        if not isinstance(self._open, kind):
            events += self._close("completed")
            if kind is MessageItem:
                item: OutputItem = MessageItem(id=item_id("msg"), status="in_progress")
                part: OutputText | ReasoningText = OutputText(text="")
            else:
                item = ReasoningItem(id=item_id("rs"), status="in_progress")
                part = ReasoningText(text="")
            events += self._add(item)
            events.append(self._part_event("response.content_part.added", item, part))
            item.content.append(part)  # type: ignore[union-attr, arg-type]  # matching kinds
        item = self._open
        assert isinstance(item, (MessageItem, ReasoningItem))
        item.content[0].text += text
        prefix = "response.output_text" if kind is MessageItem else "response.reasoning_text"
        extra = {"logprobs": []} if kind is MessageItem else {}
        events.append(
            self.event(
                f"{prefix}.delta",
                item_id=item.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _add(self, item: OutputItem) -> list[str]:
        self.items.append(item)
        self._open = item
        added = self.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump()
        )
        return [added]

    def _part_event(
        self, event_type: str, item: OutputItem, part: OutputText | ReasoningText
    ) -> str:
        return self.event(
            event_type,
            item_id=item.id,
            output_index=len(self.items) - 1,
            content_index=0,
            part=part.model_dump(),
        )

    def _close(self, status: ItemStatus) -> list[str]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item.status = status
        index = len(self.items) - 1
        events = []
        if isinstance(item, FunctionCallItem):
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        else:
            part = item.content[0]
            prefix = (
                "response.output_text"
                if isinstance(item, MessageItem)
                else ("response.reasoning_text")
            )
            extra = {"logprobs": []} if isinstance(item, MessageItem) else {}
            events.append(
                self.event(
                    f"{prefix}.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=part.text,
                    **extra,
                )
            )
            events.append(self._part_event("response.content_part.done", item, part))
        events.append(
            self.event("response.output_item.done", output_index=index, item=item.model_dump())
        )
        return events
