"""What the completion, chat and tokenize handlers share: model names, prompt checks,
request limits and admission (503 when full), usage, server-sent events, and running a
request until its client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest

from tokenserve.engine.async_llm import AsyncLLM, RequestOutputCollector, RequestOutputStream
from tokenserve.entrypoints.openai.errors import OpenAIError, error_from_exception
from tokenserve.entrypoints.openai.limits import ServingLimits, server_full_error
from tokenserve.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from tokenserve.entrypoints.openai.serving_models import OpenAIServingModels
from tokenserve.lora.request import LoRARequest
from tokenserve.outputs import RequestOutput
from tokenserve.sampling_params import SamplingParams

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


class EventStream:
    """An SSE body and the engine requests under it.

    Closing it aborts every unfinished request, even when the body never started (a
    client that left before its first event): the server closes it when the response ends.
    """

    def __init__(
        self, events: AsyncGenerator[str, None], outputs: Sequence[RequestOutputStream]
    ) -> None:
        self.events = events
        self.outputs = list(outputs)

    async def aclose(self) -> None:
        await self.events.aclose()
        for output in self.outputs:
            await output.aclose()


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: Sequence[str],
        chat_template: str | None = None,
        limits: ServingLimits | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = list(served_model_names)
        self.max_model_len = engine.config.model_config.max_model_len
        self.chat_template = chat_template
        self.limits = limits or ServingLimits()
        # Sequences the engine may hold at once: running (on every data-parallel engine)
        # plus waiting.
        self.capacity = (
            engine.config.scheduler_config.max_num_seqs
            * engine.config.parallel_config.data_parallel_size
            + self.limits.max_waiting_requests
        )
        # The base names and LoRA adapters, when the app has them (serving_models.py).
        self.models: OpenAIServingModels | None = None

    def check_model(self, model: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        if self.models is not None:
            return self.models.check_model(model)
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise OpenAIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return model

    def lora_request_for(self, model_name: str) -> LoRARequest | None:
        """The adapter a checked model name picks; None for the base model."""
        return self.models.lora_request(model_name) if self.models is not None else None

    def check_prompt_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """400 unless the prompt, plus max_tokens when given, fits in max_model_len."""
        if num_prompt_tokens >= self.max_model_len or (
            max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len
        ):
            requested = num_prompt_tokens + (max_tokens or 0)
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{max_tokens or 0} for the completion). Shorten the prompt or lower max_tokens.",
                param="max_tokens" if num_prompt_tokens < self.max_model_len else "messages",
                code="context_length_exceeded",
            )

    async def add_requests(
        self,
        request_id: str,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[RequestOutputStream]:
        """Add one engine request per (text, token ids) prompt; all or none are added.
        With `multi_modal_data` (fetched images) the engine's processor expands each image
        placeholder in the token ids into the image's tokens.

        Validation errors surface here, before any response (or stream) has started: 400
        beyond the request limits, 503 (Retry-After) when the engine holds all it may.
        """
        self.limits.check_sampling(params)
        num_sequences = len(prompts) * params.n
        if num_sequences > self.capacity:
            raise OpenAIError(
                400,
                f"This request asks for {num_sequences} sequences ({len(prompts)} prompts, "
                f"n={params.n}); this server holds at most {self.capacity} at once.",
                param="n",
            )
        num_unfinished = self.engine.num_unfinished_requests
        if num_unfinished + num_sequences > self.capacity:
            raise server_full_error(num_unfinished, self.capacity)
        added: list[tuple[str, RequestOutputCollector]] = []
        try:
            for index, (text, token_ids) in enumerate(prompts):
                engine_request_id = f"{request_id}-{index}"
                prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
                if multi_modal_data:
                    prompt["multi_modal_data"] = multi_modal_data
                collector = await self.engine.add_request(
                    engine_request_id,
                    prompt,
                    params,
                    priority=priority,
                    cache_salt=cache_salt,
                    lora_request=lora_request,
                )
                added.append((engine_request_id, collector))
        except BaseException:
            for engine_request_id, _ in added:
                self.engine.abort(engine_request_id)
            raise
        return [self.engine.iterate_outputs(rid, collector) for rid, collector in added]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


# Characters that JSON may leave raw in a string but that line readers built on
# str.splitlines (httpx's aiter_lines among them) take for line breaks, cutting an event in
# two: written as escapes (the same JSON), an event stays one line whatever text it carries.
_LINE_BREAKS_TO_ESCAPES = str.maketrans(
    {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def sse(payload: Any) -> str:
    """One server-sent event carrying a pydantic model or a plain JSON value."""
    if hasattr(payload, "model_dump_json"):
        data = payload.model_dump_json(exclude_none=False).translate(_LINE_BREAKS_TO_ESCAPES)
        return f"data: {data}\n\n"
    return f"data: {json.dumps(payload)}\n\n"  # ASCII: every non-ASCII character escaped


def sse_error(error: BaseException) -> str:
    """The event that ends a stream that failed after its 200 status was sent."""
    return sse(error_from_exception(error).to_response().model_dump())


async def merge_generators(
    generators: Sequence[AsyncIterator[T]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async generators as they come, tagged with the generator's index.

    Closing (or cancelling) the merge cancels every producer, so each aborts its request.
    """
    if len(generators) == 1:
        async for item in generators[0]:
            yield 0, item
        return
    # (index, item, None), (index, None, error) or None when a producer is done.
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None] | None] = asyncio.Queue()

    async def produce(index: int, generator: AsyncIterator[T]) -> None:
        try:
            async for item in generator:
                await queue.put((index, item, None))
        except Exception as error:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((index, None, error))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(produce(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            index, value, error = entry
            if error is not None:
                raise error
            yield index, value  # type: ignore[misc]  # a T, since there was no error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_final_outputs(
    outputs: Sequence[RequestOutputStream], raw_request: HTTPRequest
) -> list[RequestOutput]:
    """The final output of each request (FINAL_ONLY requests), in order.

    Raises ClientDisconnected, after aborting every request, if the client goes away first.
    """

    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(outputs)
        async for index, output in merge_generators(outputs):
            finals[index] = output
        return [final for final in finals if final is not None]

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)
        # Aborts whatever is unfinished, even a stream the cancelled collector never read.
        for output in outputs:
            await output.aclose()
    if collector.cancelled():
        raise ClientDisconnected()
    return collector.result()


async def _wait_for_disconnect(raw_request: HTTPRequest) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return
