"""`tokenserve proxy`: one OpenAI endpoint in front of prefill and decode instances (P/D).

Each /v1/completions or /v1/chat/completions request goes first to a prefill instance
(round robin) with `max_tokens` 1 and `kv_transfer_params: {"do_remote_decode": true}`;
the `kv_transfer_params` it answers with go, with the original body, to a decode
instance, which pulls the KV (P2pConnector) and answers the client, streaming or not.
A prefill that fails (unreachable, an error, no transfer parameters) and a decode whose
KV never arrived (finish reason "abort") are OpenAI-style errors (502) to the client;
the instances free their blocks themselves (docs/KV_CONNECTORS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenserve.entrypoints.openai.errors import OpenAIError

ROUTES = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADERS = ("authorization",)


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    body = OpenAIError(status, message, code=code).to_response().model_dump()
    return JSONResponse(body, status_code=status)


class DisaggProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("tokenserve proxy needs at least one --prefill and one --decode URL.")
        self.prefill_urls = itertools.cycle([url.rstrip("/") for url in prefill_urls])
        self.decode_urls = itertools.cycle([url.rstrip("/") for url in decode_urls])
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def handle(self, route: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return _error(400, "The request body is not valid JSON.")
        if not isinstance(body, dict):
            return _error(400, "The request body must be a JSON object.")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        prefill_url = next(self.prefill_urls)
        prefill_body = {**body, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True}}
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        try:
            prefill = await self.client.post(
                prefill_url + route, json=prefill_body, headers=headers
            )
        except httpx.HTTPError as error:
            return _error(502, f"The prefill instance {prefill_url} failed: {error!r}.")
        if prefill.status_code != 200:
            return Response(prefill.content, prefill.status_code, media_type="application/json")
        params = prefill.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            return _error(502, f"The prefill instance {prefill_url} returned no "
                               "kv_transfer_params: is it a kv_producer (P2pConnector)?")
        decode_url = next(self.decode_urls)
        decode_body = {**body, "kv_transfer_params": params}
        upstream = self.client.build_request(
            "POST", decode_url + route, json=decode_body, headers=headers
        )
        try:
            response = await self.client.send(upstream, stream=bool(body.get("stream")))
        except httpx.HTTPError as error:
            return _error(502, f"The decode instance {decode_url} failed: {error!r}.")
        if not body.get("stream") or response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            if response.status_code == 200 and _aborted(json.loads(content)):
                return _transfer_failed(decode_url)
            return Response(content, response.status_code, media_type="application/json")
        return StreamingResponse(
            _relay_events(response, decode_url), media_type="text/event-stream"
        )

    async def close(self) -> None:
        await self.client.aclose()


def _aborted(event: dict[str, Any]) -> bool:
    return any(choice.get("finish_reason") == "abort" for choice in event.get("choices") or [])


def _transfer_failed(decode_url: str) -> JSONResponse:
    return _error(502, f"The decode instance {decode_url} could not load the KV from the "
                       "prefill instance (KV transfer failed).", code="kv_transfer_failed")


async def _relay_events(response: httpx.Response, decode_url: str) -> AsyncIterator[bytes]:
    """The decode instance's events as they come; a choice ended by a failed KV transfer
    becomes an error event."""
    try:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                if _aborted(event):
                    error = json.loads(_transfer_failed(decode_url).body)
                    yield f"data: {json.dumps(error)}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
            if line:
                yield f"{line}\n\n".encode()
    finally:
        await response.aclose()


def build_proxy_app(proxy: DisaggProxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = FastAPI(title="tokenserve proxy", lifespan=lifespan)

    for route in ROUTES:
        async def forward(request: Request, route: str = route) -> Response:
            return await proxy.handle(route, request)

        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def add_proxy_parser(subcommands: Any) -> None:
    proxy = subcommands.add_parser(
        "proxy",
        help="Serve prefill/decode disaggregation: one OpenAI endpoint in front of prefill "
             "and decode instances (P2pConnector).",
    )
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                       help="Prefill instances (kv_producer), e.g. http://127.0.0.1:8100.")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL",
                       help="Decode instances (kv_consumer).")
    proxy.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    proxy.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    proxy.add_argument("--timeout", type=float, default=600.0,
                       help="Seconds a request to an instance may take.")
    proxy.set_defaults(handler=_run_proxy)


def _run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_proxy_app(DisaggProxy(args.prefill, args.decode, args.timeout))
    uvicorn.run(app, host=args.host, port=args.port, http="h11", log_level="warning")
    return 0
