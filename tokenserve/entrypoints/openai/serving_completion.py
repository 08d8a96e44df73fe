"""POST /v1/completions: one engine request per prompt, each with `n` samples.

Choices are numbered `prompt_index * n + sample_index`, as OpenAI does. Structured outputs
come from response_format / structured_outputs / guided_* (structured_outputs.py). Streaming sends
one chunk per engine output (merged when the client reads slowly) and, with
`stream_options.include_usage`, a last chunk with the usage.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import Request as HTTPRequest

from tokenserve.entrypoints.openai.errors import OpenAIError
from tokenserve.entrypoints.openai.logprobs_format import completion_logprobs
from tokenserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from tokenserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    EventStream,
    OpenAIServing,
    collect_final_outputs,
    make_usage,
    merge_generators,
    sse,
    sse_error,
)
from tokenserve.entrypoints.openai.structured_outputs import requested_structured_outputs
from tokenserve.outputs import CompletionOutput, LogprobsDict, PromptLogprobs, RequestOutput
from tokenserve.sampling_params import SamplingParams

# The prompt's text, token ids and per-position logprobs, put before a choice by `echo`.
_Echo = tuple[str, list[int], Sequence[LogprobsDict | None]]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request: HTTPRequest
    ) -> CompletionResponse | EventStream:
        model_name = self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError(400, "suffix is not supported.", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError(400, "best_of must equal n (or be omitted).", param="best_of")
        prompts = self._tokenize_prompts(request)
        logprobs = request.logprobs
        # Echoed prompts carry logprobs too, which needs the prompt's logprobs.
        prompt_logprobs = request.prompt_logprobs
        if request.echo and logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, logprobs)
        params = request.to_sampling_params(
            request.max_tokens, logprobs, prompt_logprobs, requested_structured_outputs(request)
        )
        request_id = random_id("cmpl")
        generators = await self.add_requests(
            request_id, prompts, params, request.priority, request.cache_salt,
            self.lora_request_for(model_name),
        )
        if request.stream:
            return EventStream(
                self._stream(request, params, request_id, model_name, generators), generators
            )
        finals = await collect_final_outputs(generators, raw_request)
        return self._response(request, params, request_id, model_name, finals)

    def _tokenize_prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            raw_prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            raw_prompts = [prompt]
        else:
            raw_prompts = list(prompt)
        if not raw_prompts:
            raise OpenAIError(400, "prompt must not be empty.", param="prompt")
        prompts = []
        for raw in raw_prompts:
            if isinstance(raw, str):
                token_ids = self.encode(raw, add_special_tokens=True)
                text = raw
            else:
                token_ids, text = list(raw), None  # the Processor checks the ids
            if not token_ids:
                raise OpenAIError(400, "prompt must contain at least one token.", param="prompt")
            self.check_prompt_length(len(token_ids), request.max_tokens)
            prompts.append((text, token_ids))
        return prompts

    # ---- non-streaming -------------------------------------------------------------

    def _response(
        self,
        request: CompletionRequest,
        params: SamplingParams,
        request_id: str,
        model_name: str,
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        for prompt_index, final in enumerate(finals):
            prompt_tokens += len(final.prompt_token_ids)
            cached_tokens += final.num_cached_tokens
            for output in sorted(final.outputs, key=lambda o: o.index):
                completion_tokens += len(output.token_ids)
                echo = self._echo(request, final, final.prompt_logprobs)
                choices.append(
                    self._choice(request, prompt_index * params.n + output.index, output, echo)
                )
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=make_usage(prompt_tokens, completion_tokens, cached_tokens),
            kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None,
        )

    def _echo(
        self,
        request: CompletionRequest,
        result: RequestOutput,
        prompt_logprobs: PromptLogprobs | None,
    ) -> _Echo | None:
        """What `echo` puts before a choice's output: the prompt, its token ids and logprobs."""
        if not request.echo:
            return None
        prompt = result.prompt
        if prompt is None:
            prompt = str(self.tokenizer.decode(result.prompt_token_ids))
        positions = prompt_logprobs or [None] * len(result.prompt_token_ids)
        return prompt, list(result.prompt_token_ids), positions

    def _choice(
        self,
        request: CompletionRequest,
        index: int,
        output: CompletionOutput,
        echo: _Echo | None,
        text_offset: int = 0,
    ) -> CompletionChoice:
        text, token_ids = output.text, list(output.token_ids)
        positions: Sequence[LogprobsDict | None] | None = output.logprobs
        if echo is not None:
            prompt, prompt_token_ids, prompt_positions = echo
            text = prompt + text
            token_ids = prompt_token_ids + token_ids
            if positions is not None:
                positions = [*prompt_positions, *positions]
        logprobs = None
        if request.logprobs is not None and positions is not None:
            logprobs = completion_logprobs(token_ids, positions, self.decode_token, text_offset)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )

    # ---- streaming -----------------------------------------------------------------

    async def _stream(
        self,
        request: CompletionRequest,
        params: SamplingParams,
        request_id: str,
        model_name: str,
        generators: Sequence[AsyncIterator[RequestOutput]],
    ) -> AsyncGenerator[str, None]:
        num_prompts = len(generators)
        prompt_tokens = [0] * num_prompts
        cached_tokens = [0] * num_prompts
        completion_tokens = [0] * (num_prompts * params.n)
        text_offsets = [0] * (num_prompts * params.n)
        started = [False] * (num_prompts * params.n)
        # Prompt logprobs come once per prompt (with one of its n samples); echo needs them.
        prompt_logprobs: list[PromptLogprobs | None] = [None] * num_prompts
        try:
            async for prompt_index, result in merge_generators(generators):
                prompt_tokens[prompt_index] = len(result.prompt_token_ids)
                cached_tokens[prompt_index] = result.num_cached_tokens
                prompt_logprobs[prompt_index] = (
                    prompt_logprobs[prompt_index] or result.prompt_logprobs
                )
                choices = []
                for output in result.outputs:
                    index = prompt_index * params.n + output.index
                    first = not started[index]
                    if not (output.text or output.token_ids or output.finished or first):
                        continue
                    started[index] = True
                    echo = (
                        self._echo(request, result, prompt_logprobs[prompt_index])
                        if first
                        else None
                    )
                    choice = self._choice(request, index, output, echo, text_offsets[index])
                    completion_tokens[index] += len(output.token_ids)
                    text_offsets[index] += len(choice.text)
                    choices.append(choice)
                if not choices:
                    continue
                chunk = CompletionResponse(id=request_id, model=model_name, choices=choices)
                if request.continuous_usage:
                    chunk.usage = make_usage(
                        sum(prompt_tokens), sum(completion_tokens), sum(cached_tokens)
                    )
                yield sse(chunk)
            if request.include_usage:
                usage = make_usage(sum(prompt_tokens), sum(completion_tokens), sum(cached_tokens))
                yield sse(
                    CompletionResponse(id=request_id, model=model_name, choices=[], usage=usage)
                )
        except Exception as error:  # noqa: BLE001 - the status is sent; the error goes in the stream
            yield sse_error(error)
        yield SSE_DONE
