"""POST /v1/chat/completions: render the conversation with the chat template, then generate.

Streaming follows OpenAI's chunk order: per choice a first chunk with the assistant role,
then content deltas (the last one carrying the finish reason), then, with
`stream_options.include_usage`, a chunk with no choices and the usage.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request as HTTPRequest

from tokenserve.entrypoints.chat_utils import render_chat
from tokenserve.entrypoints.openai.errors import OpenAIError
from tokenserve.entrypoints.openai.logprobs_format import chat_logprobs
from tokenserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
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
from tokenserve.outputs import CompletionOutput, RequestOutput
from tokenserve.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def render_messages(
        self,
        messages: list[ChatMessage],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict | None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text; a request's own template beats --chat-template beats the model's."""
        if chat_template is not None and not self.limits.trust_request_chat_template:
            raise OpenAIError(
                400,
                "chat_template in a request is refused: the server was not started with "
                "--trust-request-chat-template.",
                param="chat_template",
            )
        return render_chat(
            self.tokenizer,
            [message.model_dump(exclude_none=True) for message in messages],
            # A request's template is taken inline only: never as a path on this machine.
            chat_template=chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: HTTPRequest
    ) -> ChatCompletionResponse | EventStream:
        model_name = self.check_model(request.model)
        text = self.render_messages(
            request.messages,
            request.chat_template,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            request.tools,
        )
        token_ids = self.encode(text, add_special_tokens=request.add_special_tokens)
        max_tokens = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        self.check_prompt_length(len(token_ids), max_tokens)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = request.to_sampling_params(max_tokens, logprobs, request.prompt_logprobs)
        request_id = random_id("chatcmpl")
        [outputs] = await self.add_requests(
            request_id, [(text, token_ids)], params, request.priority, request.cache_salt
        )
        if request.stream:
            return EventStream(
                self._stream(request, params, request_id, model_name, outputs), [outputs]
            )
        [final] = await collect_final_outputs([outputs], raw_request)
        return self._response(request, request_id, model_name, final)

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
    ) -> ChatCompletionResponse:
        echo = self._echo_text(request)
        choices = [
            ChatCompletionChoice(
                index=output.index,
                message=ChatResponseMessage(content=echo + output.text),
                logprobs=self._logprobs(request, output),
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            )
            for output in sorted(final.outputs, key=lambda o: o.index)
        ]
        completion_tokens = sum(len(output.token_ids) for output in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=make_usage(
                len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens
            ),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        params: SamplingParams,
        request_id: str,
        model_name: str,
        outputs: AsyncIterator[RequestOutput],
    ) -> AsyncGenerator[str, None]:
        prompt_tokens = cached_tokens = 0
        completion_tokens = [0] * params.n
        started = [False] * params.n
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
                choices = []
                for output in result.outputs:
                    index = output.index
                    if not started[index]:
                        started[index] = True
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
                    choices.append(
                        ChatCompletionStreamChoice(
                            index=index,
                            delta=DeltaMessage(content=output.text),
                            logprobs=self._logprobs(request, output),
                            finish_reason=output.finish_reason,
                            stop_reason=output.stop_reason,
                        )
                    )
                if choices:
                    yield chunk(choices)
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
