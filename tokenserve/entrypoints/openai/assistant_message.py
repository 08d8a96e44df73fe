"""One choice's output → the assistant message: reasoning, content and tool calls.

The reasoning parser (`--reasoning-parser`) reads the output first; the tool-call parser
reads the content that follows the reasoning: the `--tool-call-parser` one for
tool_choice "auto", the server's own format for "required" and a named function
(tool_parsers/forced.py). With neither, the output is the content as it is. Whole outputs
and deltas go through the same parsers, so a stream joins to the non-streamed message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenserve.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ToolChoice,
    random_id,
)
from tokenserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from tokenserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    FunctionCallText,
    ParsedDelta,
    ToolParser,
)
from tokenserve.entrypoints.openai.tool_parsers.forced import (
    NamedToolCallParser,
    RequiredToolCallsParser,
)


@dataclass(frozen=True)
class ChatParsing:
    """The server's parsing flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    tool_call_parser: str | None = None  # --tool-call-parser
    reasoning_parser: str | None = None  # --reasoning-parser
    # --structured-outputs-config.enable_in_reasoning: grammars constrain the reasoning too.
    structured_outputs_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"Unknown tool call parser {self.tool_call_parser!r}; choose one of "
                f"{', '.join(sorted(TOOL_PARSERS))}."
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"Unknown reasoning parser {self.reasoning_parser!r}; choose one of "
                f"{', '.join(sorted(REASONING_PARSERS))}."
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")

    @property
    def auto_tool_choice(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    @property
    def reasoning_parser_class(self) -> type[ReasoningParser] | None:
        return REASONING_PARSERS[self.reasoning_parser] if self.reasoning_parser else None

    def prompt_ends_reasoning(self, prompt: str) -> bool:
        reasoning_class = self.reasoning_parser_class
        return reasoning_class is not None and reasoning_class.prompt_ends_reasoning(prompt)

    def new_message_parser(
        self, tool_choice: ToolChoice, reasoning_ended: bool
    ) -> AssistantMessageParser:
        """A parser for one choice of a request with this (checked) tool choice."""
        reasoning_class = self.reasoning_parser_class
        reasoning = reasoning_class(reasoning_ended) if reasoning_class else None
        tools: ToolParser | None = None
        if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
            tools = NamedToolCallParser(tool_choice.function.name)
        elif tool_choice == "required":
            tools = RequiredToolCallsParser()
        elif tool_choice == "auto" and self.tool_call_parser is not None:
            tools = TOOL_PARSERS[self.tool_call_parser]()
        return AssistantMessageParser(reasoning, tools)


@dataclass
class AssistantMessage:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[FunctionCallText] = field(default_factory=list)


class AssistantMessageParser:
    def __init__(
        self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.tools_called = False
        self._content_seen = False

    def parse(self, text: str) -> AssistantMessage:
        """A whole output."""
        if self.reasoning is None and self.tools is None:
            return AssistantMessage(content=text)
        reasoning, content = self.reasoning.extract(text) if self.reasoning else (None, text)
        if self.tools is None or not content:
            return AssistantMessage(content, reasoning)
        extracted = self.tools.extract(content)
        self.tools_called = bool(extracted.calls)
        return AssistantMessage(extracted.content, reasoning, extracted.calls)

    def feed(self, text: str) -> list[DeltaMessage]:
        """The next delta of the output → the stream's deltas (maybe none, while a marker
        may be starting). Without parsers, exactly one content delta."""
        if self.reasoning is None and self.tools is None:
            return [DeltaMessage(content=text)]
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._deltas(reasoning, self._tools_feed(content))

    def finish(self) -> list[DeltaMessage]:
        """The output has ended: what the parsers held back."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        parsed = self._tools_feed(content)
        if self.tools is not None and self._content_seen:
            parsed.extend(self.tools.finish())
        return self._deltas(reasoning, parsed)

    def _tools_feed(self, content: str) -> ParsedDelta:
        # The tool parser sees only content: nothing while the model is still reasoning.
        if self.tools is None or not content:
            return ParsedDelta(content=content)
        self._content_seen = True
        return self.tools.feed(content)

    def _deltas(self, reasoning: str, parsed: ParsedDelta) -> list[DeltaMessage]:
        """Reasoning and content in one delta; then a call's first delta (id, type, name,
        arguments ""), then its argument pieces, each in a delta of its own."""
        deltas = []
        if reasoning or parsed.content:
            deltas.append(
                DeltaMessage(reasoning_content=reasoning or None, content=parsed.content or None)
            )
        for call in parsed.calls:
            if call.name is not None:
                self.tools_called = True
                function = DeltaFunctionCall(name=call.name, arguments="")
                deltas.append(
                    DeltaMessage(
                        tool_calls=[
                            DeltaToolCall(
                                index=call.index,
                                id=random_id("chatcmpl-tool"),
                                type="function",
                                function=function,
                            )
                        ]
                    )
                )
            elif call.arguments:
                function = DeltaFunctionCall(arguments=call.arguments)
                deltas.append(
                    DeltaMessage(tool_calls=[DeltaToolCall(index=call.index, function=function)])
                )
        return deltas
