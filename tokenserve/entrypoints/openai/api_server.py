"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an AsyncLLM.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET,
DELETE, POST .../cancel of /v1/responses/{id}), GET /v1/models, GET /v1/models/{id},
GET /health, GET /version, POST /tokenize, POST /detokenize, GET /metrics; for pooling models
(serving_pooling.py) POST /v1/embeddings, /score, /rerank, /classify; with
--allow-runtime-lora-updating, POST /v1/load_lora_adapter and /v1/unload_lora_adapter. With
API keys, every
route but /health and /metrics needs `Authorization: Bearer <key>`, and each key's
requests use their own prefix-cache partition (auth.py). Requests are bounded in headers,
body, samples and stop strings, and refused with 503 when the engine holds all it may
(limits.py). The engine core runs in its own process; if it dies, /health answers 503,
requests fail at once with 500, and the server exits non-zero shortly after so that a
supervisor can restart it. SIGTERM drains in-flight requests for --shutdown-timeout s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from tokenserve.core.gc_heap import freeze_startup_heap
from tokenserve.engine.async_llm import AsyncLLM
from tokenserve.engine.core_process import EngineCoreProcess
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.entrypoints.chat_utils import ChatContentConfig, load_chat_template
from tokenserve.entrypoints.openai.assistant_message import ChatParsing
from tokenserve.entrypoints.openai.auth import (
    APIKeyMiddleware,
    effective_cache_salt,
    load_api_keys,
)
from tokenserve.entrypoints.openai.dashboard_routes import register_dashboard_routes
from tokenserve.entrypoints.openai.errors import OpenAIError, error_json, install_error_handlers
from tokenserve.entrypoints.openai.limits import RequestSizeMiddleware, ServingLimits
from tokenserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from tokenserve.entrypoints.openai.response_store import ResponseStore
from tokenserve.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
)
from tokenserve.entrypoints.openai.serving_base import ClientDisconnected, EventStream
from tokenserve.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenserve.entrypoints.openai.serving_models import OpenAIServingModels, parse_lora_module
from tokenserve.entrypoints.openai.serving_pooling import register_pooling_routes
from tokenserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from tokenserve.metrics.dashboard import DashboardState
from tokenserve.metrics.prometheus import PrometheusStatLogger
from tokenserve.metrics.request_trace import RequestObserver, RequestTraceRecorder
from tokenserve.multimodal.media import MediaConnector
from tokenserve.multimodal.media_security import MediaConnectorConfig
from tokenserve.version import __version__

logger = logging.getLogger(__name__)

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Images one chat prompt may fetch when --limit-mm-per-prompt does not say.
DEFAULT_MAX_IMAGES = 16
# After the engine dies, the server keeps answering 503/500 this long, then exits non-zero.
ENGINE_DEATH_EXIT_DELAY_S = 5.0


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    chat_template: str | None = None,
    api_keys: Sequence[str] = (),
    metrics: PrometheusStatLogger | None = None,
    limits: ServingLimits | None = None,
    shared_prefix_cache_across_keys: bool = False,
    parsing: ChatParsing | None = None,
    models: OpenAIServingModels | None = None,
    dashboard: DashboardState | None = None,
    chat_content: ChatContentConfig | None = None,
    media_connector: MediaConnector | None = None,
) -> FastAPI:
    """`models`: the LoRA adapters beside the served names (serving_models.py); `dashboard`:
    the engine state /dashboard shows (metrics/dashboard.py); `chat_content` and
    `media_connector`: how chat content parts reach the template, and what image URLs may
    be fetched (docs/MEDIA_SECURITY.md)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield

    limits = limits or ServingLimits()
    app = FastAPI(title="tokenserve", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    # The last added runs first: sizes are checked before keys, keys before any body is read.
    if api_keys:
        app.add_middleware(
            APIKeyMiddleware, api_keys=api_keys, salt_per_key=not shared_prefix_cache_across_keys
        )
    app.add_middleware(
        RequestSizeMiddleware,
        max_header_count=limits.max_header_count,
        max_header_size=limits.max_header_size,
        max_body_size=limits.max_request_body_size,
    )
    completion = OpenAIServingCompletion(engine, served_model_names, chat_template, limits)
    chat = OpenAIServingChat(
        engine, served_model_names, chat_template, limits, parsing, chat_content, media_connector
    )
    models = models or OpenAIServingModels(engine, served_model_names)
    completion.models = chat.models = models
    chat.warm_up()
    responses = OpenAIServingResponses(chat, ResponseStore())
    max_model_len = engine.config.model_config.max_model_len
    # /v1/embeddings, /score, /rerank, /classify (a 400 on a generate model).
    register_pooling_routes(app, engine, served_model_names, limits)
    if dashboard is not None:
        register_dashboard_routes(app, dashboard)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return error_json(OpenAIError(503, engine.dead_reason or "The engine is not running."))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return models.model_list()

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        return models.model_card(model_id)

    if models.allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            message = models.load_lora_adapter(request.lora_name, request.lora_path)
            return Response(message, media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            return Response(models.unload_lora_adapter(request.lora_name), media_type="text/plain")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: HTTPRequest) -> Response:
        request.cache_salt = effective_cache_salt(raw_request, request.cache_salt)
        return await _respond(completion.create_completion(request, raw_request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: HTTPRequest
    ) -> Response:
        request.cache_salt = effective_cache_salt(raw_request, request.cache_salt)
        return await _respond(chat.create_chat_completion(request, raw_request))

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: HTTPRequest) -> Response:
        request.cache_salt = effective_cache_salt(raw_request, request.cache_salt)
        return await _respond(responses.create_response(request, raw_request))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw_request: HTTPRequest) -> ResponseObject:
        return responses.retrieve(response_id, raw_request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw_request: HTTPRequest) -> DeletedResponse:
        return responses.delete(response_id, raw_request)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw_request: HTTPRequest) -> ResponseObject:
        return responses.cancel(response_id, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "Give exactly one of prompt and messages.")
        if request.messages is not None:
            text = chat.render_messages(
                request.messages,
                request.chat_template,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
                request.tools,
            )
            add_special_tokens = bool(request.add_special_tokens)
        else:
            text = request.prompt or ""
            add_special_tokens = request.add_special_tokens is not False
        tokens = chat.encode(text, add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(request.model)
        vocab_size = engine.config.model_config.vocab_size
        if any(not 0 <= token < vocab_size for token in request.tokens):
            raise OpenAIError(400, f"Token ids must be in [0, {vocab_size}).", param="tokens")
        return DetokenizeResponse(prompt=str(chat.tokenizer.decode(request.tokens)))

    return app


async def _respond(result: Any) -> Response:
    """A JSON body, or an SSE stream for an EventStream."""
    try:
        body = await result
    except ClientDisconnected:
        return Response(status_code=499)
    if isinstance(body, EventStream):
        return EventStreamResponse(body)
    return JSONResponse(body.model_dump())


class EventStreamResponse(StreamingResponse):
    """Server-sent events that abort their requests however the response ends.

    Starlette cancels a stream whose client disconnects, but a body cancelled before its
    first step never runs its own cleanup; closing the EventStream here always does.
    """

    def __init__(self, stream: EventStream) -> None:
        super().__init__(stream.events, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.aclose()


def served_model_names_from(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model if args.model is not None else DEFAULT_SERVED_MODEL_NAME]


def parsing_from(args: argparse.Namespace) -> ChatParsing:
    return ChatParsing(
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        structured_outputs_in_reasoning=args.structured_outputs_enable_in_reasoning,
    )


def limits_from(args: argparse.Namespace) -> ServingLimits:
    return ServingLimits(
        max_request_body_size=args.max_request_body_size,
        max_header_size=args.h11_max_incomplete_event_size,
        max_header_count=args.h11_max_header_count,
        max_n=args.max_n,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        max_waiting_requests=args.max_waiting_requests,
        trust_request_chat_template=args.trust_request_chat_template,
    )


def chat_content_from(args: argparse.Namespace) -> ChatContentConfig:
    # --limit-mm-per-prompt (an engine flag, '{"image": N}') bounds the images fetched.
    limit = getattr(args, "limit_mm_per_prompt", None)
    if isinstance(limit, str):
        limit = json.loads(limit)
    max_images = limit.get("image") if isinstance(limit, dict) else None
    return ChatContentConfig(
        content_format=args.chat_template_content_format,
        max_images_per_prompt=max_images if max_images is not None else DEFAULT_MAX_IMAGES,
    )


def media_connector_from(args: argparse.Namespace) -> MediaConnector:
    return MediaConnector(
        MediaConnectorConfig(
            allowed_media_domains=args.allowed_media_domains,
            allowed_local_media_path=args.allowed_local_media_path,
            allowed_media_networks=tuple(args.allowed_media_networks),
            media_fetch_timeout=args.media_fetch_timeout,
            max_media_bytes=args.max_media_bytes,
            max_image_pixels=args.max_image_pixels,
            max_media_redirects=args.max_media_redirects,
        )
    )


async def run_server(
    args: argparse.Namespace, engine_args: EngineArgs, engine_process: EngineCoreProcess | None = None
) -> int:
    """Start the engine, serve until SIGINT/SIGTERM (exit 0) or the engine dies (exit 1).
    `engine_process`: an engine-core process started (and maybe configured) earlier."""
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be non-negative, got {args.shutdown_timeout}.")
    api_keys = load_api_keys(args.api_key, args.api_key_file)
    limits = limits_from(args)
    parsing = parsing_from(args)
    chat_template = load_chat_template(args.chat_template)
    chat_content = chat_content_from(args)
    media_connector = media_connector_from(args)
    served_model_names = served_model_names_from(args)
    if engine_process is not None and engine_process.config is not None:
        config = engine_process.config
    else:
        config = engine_args.create_engine_config()
    # Listening from here on: a request that comes while the engine loads waits for it
    # (as vLLM's server binds before its engine is up); /health answers once it is ready.
    listen_socket = uvicorn.Config(None, host=args.host, port=args.port).bind_socket()
    metrics = PrometheusStatLogger(
        served_model_names[0], num_engines=config.parallel_config.data_parallel_size
    )
    dashboard = DashboardState()
    observers: list[RequestObserver] = [dashboard]
    if getattr(args, "request_trace", None):
        observers.append(RequestTraceRecorder(args.request_trace))
    try:
        # Not waiting for the engine core yet: the app is built while it loads (below).
        engine = AsyncLLM(config, log_stats=not args.disable_log_stats, stat_loggers=[metrics],
                          request_observers=observers, engine_process=engine_process,
                          wait_for_engine=False)
    except BaseException:
        listen_socket.close()
        raise
    mm_processor = engine.processor.mm_processor
    # The API process only tokenizes and detokenizes; the engine core gets the cores. Torch
    # is here only if the model's inputs need it (a vision model's processor, built above).
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    if mm_processor is not None:  # "string" chat templates get the model's own placeholder
        chat_content = dataclasses.replace(chat_content, image_placeholder=mm_processor.image_token)
    try:
        models = OpenAIServingModels(
            engine,
            served_model_names,
            [parse_lora_module(value) for value in args.lora_modules or []],
            args.allow_runtime_lora_updating,
        )
        app = build_app(
            engine,
            served_model_names,
            chat_template,
            api_keys,
            metrics,
            limits,
            args.shared_prefix_cache_across_keys,
            parsing,
            models,
            dashboard,
            chat_content,
            media_connector,
        )
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                # h11 (not httptools, even when installed) enforces the header-size limit.
                http="h11",
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                timeout_graceful_shutdown=args.shutdown_timeout,
            )
        )
        # Starlette streams each response in an anyio task group; the first one would import
        # anyio's asyncio backend in the middle of the first request.
        async with anyio.create_task_group():
            pass
        # What start-up built is frozen while the engine core loads (a full collection here
        # takes ~0.1 s), then this process waits for it, still stoppable by a signal.
        freeze_startup_heap()  # no full collection walks the app between streamed chunks
        try:
            engine.wait_until_ready()
        except BaseException:
            listen_socket.close()
            raise
        exit_code = 0

        def engine_died() -> None:
            nonlocal exit_code
            exit_code = 1
            logger.error("Exiting in %.0f s: the engine core is gone.", ENGINE_DEATH_EXIT_DELAY_S)
            asyncio.get_running_loop().call_later(
                ENGINE_DEATH_EXIT_DELAY_S, setattr, server, "should_exit", True
            )

        engine.on_engine_dead(engine_died)
        # uvicorn re-raises the signal it stopped on once it is done; these handlers absorb
        # it, so that the engine below is still shut down and the exit code stays ours.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: None)
        await server.serve(sockets=[listen_socket])
        if not server.started:
            exit_code = exit_code or 1
        return exit_code
    finally:
        engine.shutdown()
        logger.info("Server stopped.")
