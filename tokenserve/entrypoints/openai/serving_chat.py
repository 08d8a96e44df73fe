"""POST /v1/chat/completions: render the conversation with the chat template, then generate.

Tools reach the template; tool_choice "required" or a named function constrains the output
with a JSON schema, "auto" reads calls out of free text with `--tool-call-parser`, and
`--reasoning-parser` splits the reasoning off (assistant_message.py). Structured outputs
come from response_format / structured_outputs / guided_* (structured_outputs.py).
Image content parts are fetched concurrently here, in the API process, by the
`MediaConnector` (multimodal/media.py; a refusal is a 400 naming why), and go to the engine
as the prompt's `multi_modal_data`.

Streaming follows OpenAI's chunk order: per choice a first chunk with the assistant role,
then content, reasoning and tool-call deltas (the last one carrying the finish reason),
then, with `stream_options.include_usage`, a chunk with no choices and the usage.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest

from tokenserve.engine.async_llm import AsyncLLM
from tokenserve.entrypoints.chat_utils import (
    ChatContentConfig,
    ChatPrompt,
    ImageInput,
    render_chat_prompt,
)
from tokenserve.entrypoints.openai.assistant_message import AssistantMessageParser, ChatParsing
from tokenserve.entrypoints.openai.errors import OpenAIError
from tokenserve.entrypoints.openai.limits import ServingLimits
from tokenserve.entrypoints.openai.logprobs_format import chat_logprobs
from tokenserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionLogProbs,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionToolsParam,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    ToolChoice,
    random_id,
)
from tokenserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    EventStream,
    OpenAIServing,
    collect_final_outputs,
    make_usage,
    sse,
    sse_error,
)
from tokenserve.entrypoints.openai.structured_outputs import (
    after_reasoning,
    requested_structured_outputs,
    tool_choice_structured_outputs,
)
from tokenserve.multimodal.media import MediaConnector
from tokenserve.multimodal.media_security import MediaError
from tokenserve.outputs import CompletionOutput, RequestOutput
from tokenserve.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class PreparedChat:
    """A chat request made ready to run (also how /v1/responses runs its requests)."""

    model_name: str
    text: str  # the rendered prompt
    token_ids: list[int]
    params: SamplingParams
    new_parser: Callable[[], AssistantMessageParser]  # one per choice
    images: list[ImageInput] = field(default_factory=list)  # URLs to fetch, in prompt order


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        chat_template: str | None = None,
        limits: ServingLimits | None = None,
        parsing: ChatParsing | None = None,
        content: ChatContentConfig | None = None,
        media_connector: MediaConnector | None = None,
    ) -> None:
        super().__init__(engine, served_model_names, chat_template, limits)
        self.parsing = parsing or ChatParsing()
        self.content = content or ChatContentConfig()
        self.media_connector = media_connector or MediaConnector()
        reasoning_class = self.parsing.reasoning_parser_class
        # The grammar of a structured output waits for these tokens (the reasoning's end).
        self.reasoning_end_token_ids = (
            self.encode(reasoning_class.end_marker, add_special_tokens=False)
            if reasoning_class
            else []
        )

    def render_messages(
        self,
        messages: list[ChatMessage],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict | None,
        tools: list[ChatCompletionToolsParam] | None = None,
    ) -> str:
        """The prompt text of a conversation without images (/tokenize)."""
        prompt = self.render_prompt(
            messages, chat_template, add_generation_prompt, continue_final_message,
            chat_template_kwargs, tools,
        )
        if prompt.images:
            raise OpenAIError(
                400, "Image content parts are accepted by /v1/chat/completions only.",
                param="messages",
            )
        return prompt.text

    def render_prompt(
        self,
        messages: list[ChatMessage],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict | None,
        tools: list[ChatCompletionToolsParam] | None = None,
    ) -> ChatPrompt:
        """The prompt text and its image URLs; a request's own template beats
        --chat-template beats the model's."""
        if chat_template is not None and not self.limits.trust_request_chat_template:
            raise OpenAIError(
                400,
                "chat_template in a request is refused: the server was not started with "
                "--trust-request-chat-template.",
                param="chat_template",
            )
        return render_chat_prompt(
            self.tokenizer,
            [message.model_dump(exclude_none=True) for message in messages],
            # A request's template is taken inline only: never as a path on this machine.
            chat_template=chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=[tool.model_dump(exclude_none=True) for tool in tools] if tools else None,
            content=self.content,
        )

    def warm_up(self) -> None:
        """Render and tokenize a one-message chat as a request does, so that compiling the
        chat template and the tokenizer's first call are not the first request's (the
        server calls this while the engine core loads). A model whose template refuses
        the message, or that has none, stays cold: its requests get their errors as before."""
        try:
            prompt = self.render_prompt(
                [ChatMessage(role="user", content="Hello")], None, True, False, None
            )
        except ValueError:
            return
        self.encode(prompt.text, add_special_tokens=False)

    def check_tool_choice(self, request: ChatCompletionRequest) -> ToolChoice:
        """The request's tool choice (OpenAI's default: "auto" with tools, else "none"); 400
        for one that cannot be served."""
        tools = request.tools
        if tools is not None and not tools:
            raise OpenAIError(400, "tools must not be empty; leave it out instead.", param="tools")
        choice = request.tool_choice or ("auto" if tools else "none")
        if choice == "none":
            return choice
        if not tools:
            raise OpenAIError(400, "When using `tool_choice`, `tools` must be set.", param="tools")
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            name = choice.function.name
            if name not in {tool.function.name for tool in tools}:
                raise OpenAIError(
                    400, f"tool_choice names {name!r}, which is not in tools.", param="tool_choice"
                )
        elif choice == "auto" and not self.parsing.auto_tool_choice:
            raise OpenAIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set.",
                param="tool_choice",
            )
        return choice

    def structured_outputs(
        self, request: ChatCompletionRequest, tool_choice: ToolChoice, reasoning_ended: bool
    ) -> StructuredOutputsParams | None:
        """The request's constraint: its own, or the one its tool choice forces; with a
        reasoning parser, applied after the reasoning."""
        requested = requested_structured_outputs(request)
        forced = tool_choice_structured_outputs(
            request.tools or [], tool_choice, request.parallel_tool_calls
        )
        if requested is not None and forced is not None:
            raise OpenAIError(
                400,
                "A tool_choice that forces calls cannot be combined with response_format, "
                "structured_outputs or guided_*.",
                param="tool_choice",
            )
        structured = requested or forced
        if (
            structured is not None
            and self.reasoning_end_token_ids
            and not reasoning_ended
            and not self.parsing.structured_outputs_in_reasoning
        ):
            structured = after_reasoning(structured, self.reasoning_end_token_ids)
        return structured

    def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """The checked request as prompt, sampling params and message parsers; 4xx if bad."""
        model_name = self.check_model(request.model)
        tool_choice = self.check_tool_choice(request)
        prompt = self.render_prompt(
            request.messages,
            request.chat_template,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            request.tools,
        )
        text = prompt.text
        token_ids = self.encode(text, add_special_tokens=request.add_special_tokens)
        max_tokens = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        self.check_prompt_length(len(token_ids), max_tokens)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        reasoning_ended = self.parsing.prompt_ends_reasoning(text)
        params = request.to_sampling_params(
            max_tokens,
            logprobs,
            request.prompt_logprobs,
            self.structured_outputs(request, tool_choice, reasoning_ended),
        )
        new_parser = functools.partial(
            self.parsing.new_message_parser, tool_choice, reasoning_ended
        )
        return PreparedChat(model_name, text, token_ids, params, new_parser, prompt.images)

    async def fetch_images(self, images: list[ImageInput]) -> dict | None:
        """The prompt's `multi_modal_data`, its images fetched at once; 400 naming a refusal."""
        if not images:
            return None
        try:
            return {"image": await self.media_connector.fetch_images_async(images)}
        except MediaError as error:
            raise OpenAIError(400, str(error), param="messages") from None

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: HTTPRequest
    ) -> ChatCompletionResponse | EventStream:
        prepared = self.prepare(request)
        model_name, params, new_parser = prepared.model_name, prepared.params, prepared.new_parser
        request_id = random_id("chatcmpl")
        multi_modal_data = await self.fetch_images(prepared.images)
        [outputs] = await self.add_requests(
            request_id,
            [(prepared.text, prepared.token_ids)],
            params,
            request.priority,
            request.cache_salt,
            self.lora_request_for(model_name),
            multi_modal_data,
        )
        if request.stream:
            return EventStream(
                self._stream(request, params, request_id, model_name, outputs, new_parser),
                [outputs],
            )
        [final] = await collect_final_outputs([outputs], raw_request)
        return self._response(request, request_id, model_name, final, new_parser)

    def _echo_text(self, request: ChatCompletionRequest) -> str:
        """With `echo`, the last message's text when it is the assistant's (being continued)."""
        last = request.messages[-1]
        if request.echo and last.role == "assistant" and isinstance(last.content, str):
            return last.content
        return ""

    def _logprobs(
        self, request: ChatCompletionRequest, output: CompletionOutput
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs or output.logprobs is None:
            return None
        return chat_logprobs(
            output.token_ids, output.logprobs, request.top_logprobs or 0, self.decode_token
        )

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        final: RequestOutput,
        new_parser: Callable[[], AssistantMessageParser],
    ) -> ChatCompletionResponse:
        echo = self._echo_text(request)
        choices = []
        for output in sorted(final.outputs, key=lambda o: o.index):
            parser = new_parser()
            message = parser.parse(output.text)
            content = echo + (message.content or "") if echo else message.content
            tool_calls = [
                ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in message.tool_calls
            ]
            choices.append(
                ChatCompletionChoice(
                    index=output.index,
                    message=ChatResponseMessage(
                        content=content,
                        reasoning_content=message.reasoning_content,
                        tool_calls=tool_calls,
                    ),
                    logprobs=self._logprobs(request, output),
                    finish_reason=_finish_reason(output, parser),
                    stop_reason=output.stop_reason,
                )
            )
        completion_tokens = sum(len(output.token_ids) for output in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=make_usage(
                len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens
            ),
            kv_transfer_params=final.kv_transfer_params,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        params: SamplingParams,
        request_id: str,
        model_name: str,
        outputs: AsyncIterator[RequestOutput],
        new_parser: Callable[[], AssistantMessageParser],
    ) -> AsyncGenerator[str, None]:
        prompt_tokens = cached_tokens = 0
        completion_tokens = [0] * params.n
        parsers: list[AssistantMessageParser | None] = [None] * params.n
        echo = self._echo_text(request)

        def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id, model=model_name, choices=choices
            )
            if request.continuous_usage:
                response.usage = make_usage(prompt_tokens, sum(completion_tokens), cached_tokens)
            return sse(response)

        try:
            async for result in outputs:
                prompt_tokens = len(result.prompt_token_ids)
                cached_tokens = result.num_cached_tokens
                # A chunk holds at most one delta per choice: an output that parses into
                # several deltas (content, a call's name, its arguments) takes several chunks.
                rounds: list[list[ChatCompletionStreamChoice]] = []
                for output in result.outputs:
                    index = output.index
                    parser = parsers[index]
                    if parser is None:
                        parser = parsers[index] = new_parser()
                        yield chunk(
                            [
                                ChatCompletionStreamChoice(
                                    index=index, delta=DeltaMessage(role="assistant", content=echo)
                                )
                            ]
                        )
                    if not (output.text or output.token_ids or output.finished):
                        continue
                    completion_tokens[index] += len(output.token_ids)
                    choices = self._stream_choices(request, output, parser)
                    rounds.extend([] for _ in range(len(choices) - len(rounds)))
                    for round_choices, choice in zip(rounds, choices):
                        round_choices.append(choice)
                for round_choices in rounds:
                    yield chunk(round_choices)
            if request.include_usage:
                usage = make_usage(prompt_tokens, sum(completion_tokens), cached_tokens)
                yield sse(
                    ChatCompletionStreamResponse(
                        id=request_id, model=model_name, choices=[], usage=usage
                    )
                )
        except Exception as error:  # noqa: BLE001 - the status is sent; the error goes in the stream
            yield sse_error(error)
        yield SSE_DONE

    def _stream_choices(
        self,
        request: ChatCompletionRequest,
        output: CompletionOutput,
        parser: AssistantMessageParser,
    ) -> list[ChatCompletionStreamChoice]:
        """One output's deltas as stream choices: logprobs on the first, the finish on the last."""
        deltas = parser.feed(output.text)
        if output.finished:
            deltas.extend(parser.finish())
        logprobs = self._logprobs(request, output)
        if not deltas and (logprobs is not None or output.finished):
            deltas = [DeltaMessage()]  # held back, but the logprobs or the finish must go out
        choices = [ChatCompletionStreamChoice(index=output.index, delta=delta) for delta in deltas]
        if choices:
            choices[0].logprobs = logprobs
            choices[-1].finish_reason = _finish_reason(output, parser)
            choices[-1].stop_reason = output.stop_reason
        return choices


def _finish_reason(output: CompletionOutput, parser: AssistantMessageParser) -> str | None:
    # A request that called tools and ended by itself finished "tool_calls"; one cut by
    # max_tokens keeps "length".
    if output.finish_reason == "stop" and parser.tools_called:
        return "tool_calls"
    return output.finish_reason
