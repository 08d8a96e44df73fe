"""The pooling routes: /v1/embeddings, /score and /v1/score, /rerank, /v1/rerank and
/v2/rerank, /classify, in vLLM's shapes. One engine request per input (or per text pair),
added all or none and collected until the client leaves. A pooling route on a generate
model, or a task the model lacks, is a 400 (the engine's Processor says which)."""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from tokenserve.engine.async_llm import AsyncLLM
from tokenserve.engine.processor import PromptType
from tokenserve.entrypoints.openai.auth import effective_cache_salt
from tokenserve.entrypoints.openai.errors import OpenAIError
from tokenserve.entrypoints.openai.limits import ServingLimits, server_full_error
from tokenserve.entrypoints.openai.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingInput,
    PoolingRequestBase,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from tokenserve.entrypoints.openai.protocol import random_id
from tokenserve.entrypoints.openai.serving_base import (
    ClientDisconnected,
    OpenAIServing,
    collect_final_outputs,
    make_usage,
)
from tokenserve.entrypoints.scoring import cosine_similarity, cross_encoder_prompt, score_pairs
from tokenserve.outputs import PoolingRequestOutput
from tokenserve.pooling_params import PoolingParams


class OpenAIServingPooling(OpenAIServing):
    async def create_embedding(
        self, request: EmbeddingRequest, raw_request: HTTPRequest
    ) -> EmbeddingResponse:
        model = self.check_model(request.model)
        params = request.to_pooling_params("embed")
        outputs = await self._pool(request, _prompts(request.input), params, raw_request)
        data = [
            EmbeddingResponseData(
                index=index,
                embedding=_encode_embedding(output.outputs.data, request.encoding_format),
            )
            for index, output in enumerate(outputs)
        ]
        return EmbeddingResponse(model=model, data=data, usage=_usage(outputs))

    async def create_score(self, request: ScoreRequest, raw_request: HTTPRequest) -> ScoreResponse:
        model = self.check_model(request.model)
        scores, outputs = await self._score(
            request, score_pairs(request.text_1, request.text_2), raw_request
        )
        data = [ScoreResponseData(index=index, score=score) for index, score in enumerate(scores)]
        return ScoreResponse(model=model, data=data, usage=_usage(outputs))

    async def create_rerank(
        self, request: RerankRequest, raw_request: HTTPRequest
    ) -> RerankResponse:
        model = self.check_model(request.model)
        if not request.documents:
            raise OpenAIError(400, "documents must hold at least one text.", param="documents")
        pairs = [(request.query, document) for document in request.documents]
        scores, outputs = await self._score(request, pairs, raw_request)
        results = [
            RerankResult(index=index, document=RerankDocument(text=document), relevance_score=score)
            for index, (document, score) in enumerate(zip(request.documents, scores))
        ]
        results.sort(key=lambda result: result.relevance_score, reverse=True)
        if request.top_n:
            results = results[: request.top_n]
        total = sum(len(output.prompt_token_ids) for output in outputs)
        return RerankResponse(model=model, usage=RerankUsage(total_tokens=total), results=results)

    async def create_classify(
        self, request: ClassificationRequest, raw_request: HTTPRequest
    ) -> ClassificationResponse:
        model = self.check_model(request.model)
        params = request.to_pooling_params("classify")
        outputs = await self._pool(request, _prompts(request.input), params, raw_request)
        id2label = getattr(self.engine.config.model_config.hf_config, "id2label", None) or {}
        data = []
        for index, output in enumerate(outputs):
            probs = output.outputs.data
            best = int(np.argmax(probs))
            label = id2label.get(best, id2label.get(str(best)))
            data.append(
                ClassificationData(index=index, label=label, probs=probs, num_classes=len(probs))
            )
        return ClassificationResponse(model=model, data=data, usage=_usage(outputs))

    async def _score(
        self,
        request: ScoreRequest | RerankRequest,
        pairs: list[tuple[str, str]],
        raw_request: HTTPRequest,
    ) -> tuple[list[float], list[PoolingRequestOutput]]:
        """A cross-encoder's score per pair, or an embedding model's cosine similarity."""
        if "score" in self.engine.config.model_config.pooling_tasks:
            params = request.to_pooling_params("score")
            prompts: list[PromptType] = [
                cross_encoder_prompt(self.tokenizer, a, b, params.truncate_prompt_tokens)
                for a, b in pairs
            ]
            outputs = await self._pool(request, prompts, params, raw_request)
            return [output.outputs.data[0] for output in outputs], outputs
        params = request.to_pooling_params("embed")
        texts: list[PromptType] = [text for pair in pairs for text in pair]
        outputs = await self._pool(request, texts, params, raw_request)
        scores = [
            cosine_similarity(first.outputs.data, second.outputs.data)
            for first, second in zip(outputs[::2], outputs[1::2])
        ]
        return scores, outputs

    async def _pool(
        self,
        request: PoolingRequestBase,
        prompts: Sequence[PromptType],
        params: PoolingParams,
        raw_request: HTTPRequest,
    ) -> list[PoolingRequestOutput]:
        """Every prompt pooled (added all or none); 400 for what the model cannot do."""
        if len(prompts) > self.capacity:
            raise OpenAIError(
                400,
                f"This request has {len(prompts)} inputs; this server holds at most "
                f"{self.capacity} at once.",
                param="input",
            )
        num_unfinished = self.engine.num_unfinished_requests
        if num_unfinished + len(prompts) > self.capacity:
            raise server_full_error(num_unfinished, self.capacity)
        cache_salt = effective_cache_salt(raw_request, request.cache_salt)
        request_id = random_id("pool")
        streams = []
        try:
            for index, prompt in enumerate(prompts):
                engine_request_id = f"{request_id}-{index}"
                collector = await self.engine.add_request(
                    engine_request_id, prompt, params, request.priority, cache_salt
                )
                streams.append(self.engine.iterate_outputs(engine_request_id, collector))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        outputs = await collect_final_outputs(streams, raw_request)
        return [output for output in outputs if isinstance(output, PoolingRequestOutput)]


def _prompts(value: PoolingInput) -> list[PromptType]:
    """An input as prompts: a text, texts, one prompt's token ids, or several prompts'."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError(400, "input must not be empty.", param="input")
    if all(isinstance(item, int) for item in value):
        return [list(value)]
    return list(value)


def _encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        # OpenAI's encoding: the float32 values' little-endian bytes, base64.
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


def _usage(outputs: Sequence[PoolingRequestOutput]):
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    cached = sum(output.num_cached_tokens for output in outputs)
    return make_usage(prompt_tokens, 0, cached)


def register_pooling_routes(
    app: FastAPI, engine: AsyncLLM, served_model_names: list[str], limits: ServingLimits
) -> None:
    """The pooling routes on `app` (vLLM's paths)."""
    serving = OpenAIServingPooling(engine, served_model_names, limits=limits)

    async def respond(handler, request, raw_request: HTTPRequest) -> Response:
        try:
            body = await handler(request, raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body.model_dump())

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: HTTPRequest) -> Response:
        return await respond(serving.create_embedding, request, raw_request)

    async def score(request: ScoreRequest, raw_request: HTTPRequest) -> Response:
        return await respond(serving.create_score, request, raw_request)

    async def rerank(request: RerankRequest, raw_request: HTTPRequest) -> Response:
        return await respond(serving.create_rerank, request, raw_request)

    @app.post("/classify")
    async def classify(request: ClassificationRequest, raw_request: HTTPRequest) -> Response:
        return await respond(serving.create_classify, request, raw_request)

    for path in ("/score", "/v1/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)
