"""What the server accepts: bounds on one request, and on all the work it holds at once.

Per request: the number and total size of HTTP headers (h11 bounds a header block still
arriving by `--h11-max-incomplete-event-size`, but accepts a larger one that arrives
whole, so the size is checked again here), the body size (by Content-Length before
reading, and by the bytes actually read, which covers chunked bodies), `n`, the
number and length of stop strings, and whether a request may bring its own chat template.
In total: at most `max_num_seqs + max_waiting_requests` sequences are in the engine at
once; beyond that a request gets 503 with Retry-After instead of a place in an unbounded
queue (checked where requests are added, `serving_base.OpenAIServing.add_requests`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenserve.entrypoints.openai.errors import OpenAIError


def _openai_error(*args: Any, **kwargs: Any) -> OpenAIError:
    # errors.py brings fastapi: imported at the first error, not when `tokenserve serve`
    # parses its flags (ServingLimits gives the defaults; docs/STARTUP.md).
    from tokenserve.entrypoints.openai.errors import OpenAIError

    return OpenAIError(*args, **kwargs)


async def _send_error(error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
    from tokenserve.entrypoints.openai.errors import error_json

    await error_json(error)(scope, receive, send)

# What a client is told to wait before retrying when the server is full.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServingLimits:
    """The server's limits (each a `tokenserve serve` flag; docs/SECURITY.md)."""

    max_request_body_size: int = 4 * 1024**2
    max_header_size: int = 32 * 1024  # names and values, in bytes
    max_header_count: int = 100
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_length: int = 512
    # Sequences (prompts x n) that may wait beyond the max_num_seqs running ones.
    max_waiting_requests: int = 1024
    # A chat template in a request is code run by the server (in jinja2's sandbox, but
    # unbounded in time); it is refused unless the operator trusts every caller.
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_request_body_size",
            "max_header_size",
            "max_header_count",
            "max_n",
            "max_stop_strings",
            "max_stop_string_length",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_waiting_requests < 0:
            raise ValueError(
                f"max_waiting_requests must be non-negative, got {self.max_waiting_requests}."
            )

    def check_sampling(self, params: SamplingParams) -> None:
        """400 for a request asking for more samples or stop strings than allowed."""
        if params.n > self.max_n:
            raise _openai_error(400, f"n must be at most {self.max_n}, got {params.n}.", param="n")
        stop = params.stop or []
        if len(stop) > self.max_stop_strings:
            raise _openai_error(
                400,
                f"At most {self.max_stop_strings} stop strings are allowed, got {len(stop)}.",
                param="stop",
            )
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_string_length:
            raise _openai_error(
                400,
                f"Stop strings may be at most {self.max_stop_string_length} characters long, "
                f"got one of {longest}.",
                param="stop",
            )


def server_full_error(num_unfinished: int, capacity: int) -> OpenAIError:
    return _openai_error(
        503,
        f"The server is at capacity ({num_unfinished} of {capacity} sequences running or "
        "waiting). Retry later.",
        code="server_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class RequestSizeMiddleware:
    """431 for too many or too large headers; 413 for a body larger than the limit."""

    def __init__(
        self, app: ASGIApp, max_header_count: int, max_header_size: int, max_body_size: int
    ) -> None:
        self.app = app
        self.max_header_count = max_header_count
        self.max_header_size = max_header_size
        self.max_body_size = max_body_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        header_size = sum(len(name) + len(value) for name, value in headers)
        if len(headers) > self.max_header_count or header_size > self.max_header_size:
            error = _openai_error(
                431,
                f"The request headers ({len(headers)}, {header_size} bytes) exceed the limit "
                f"of {self.max_header_count} headers and {self.max_header_size} bytes.",
            )
            await _send_error(error, scope, receive, send)
            return
        content_length = Headers(scope=scope).get("content-length", "")
        if content_length.isdigit() and int(content_length) > self.max_body_size:
            await _send_error(self._too_large(), scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            # A body without Content-Length (chunked) is counted as it is read; FastAPI turns
            # an HTTPException raised while it reads the body into the error response.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_size:
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, receive_within_limit, send)

    def _too_large(self) -> OpenAIError:
        return _openai_error(
            413, f"The request body is larger than the limit of {self.max_body_size} bytes."
        )
