"""Streaming `/v1/completions` requests to any OpenAI-compatible server, timed per chunk.

Works against tokenserve, vLLM and llama.cpp's llama-server: the body carries the common
fields plus vLLM's `ignore_eos` (which llama-server reads too) and, for llama-server,
`n_predict`. Unknown fields are ignored by all three.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenserve.benchmarks.datasets import BenchRequest

# How the prompt goes over the wire: token ids (`prompt: [ids]`) or the decoded text.
PROMPT_FORMATS = ("token-ids", "text")
BACKENDS = ("openai", "llama.cpp")
# An id every tokenizer in use has: the smallest id the random datasets draw.
TOKEN_PROBE_ID = 100


@dataclass
class RequestResult:
    """What one request measured; times are seconds, `send_time` relative to the start."""

    group: str
    send_time: float = 0.0
    success: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    # Arrival times (since send) of every chunk that carried a choice.
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0  # the server's count when it reports usage, else ours
    output_tokens: int = 0  # the server's usage when reported, else one per content chunk
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def time_per_output_token(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class CompletionTarget:
    """Where and how to send: the server, the served model name, and the body's options."""

    base_url: str
    endpoint: str
    model: str
    backend: str = "openai"
    ignore_eos: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def body(self, prompt: str | Sequence[int], max_tokens: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.backend == "llama.cpp":
            body["n_predict"] = max_tokens
        return body


async def send_streaming(
    client: httpx.AsyncClient,
    target: CompletionTarget,
    request: BenchRequest,
    prompt: str | list[int],
    local_prompt_tokens: int,
) -> RequestResult:
    """Send one streaming completion and time its chunks; never raises for server errors."""
    result = RequestResult(group=request.group, prompt_tokens=local_prompt_tokens)
    body = target.body(prompt, request.output_len, stream=True)
    content_chunks = 0
    usage: dict[str, Any] | None = None
    started = time.perf_counter()
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {detail[:500]}"
                return result
            async for line in sse_lines(response):
                data = _sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {json.dumps(chunk['error'])[:500]}"
                    return result
                now = time.perf_counter() - started
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                if result.ttft is None:
                    result.ttft = now
                result.chunk_times.append(now)
                text = choices[0].get("text") or ""
                result.text += text
                content_chunks += bool(text)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - started
    result.output_tokens = content_chunks
    if usage is not None:
        result.output_tokens = int(usage.get("completion_tokens") or content_chunks)
        result.prompt_tokens = int(usage.get("prompt_tokens") or local_prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" in details:
            result.cached_tokens = int(details["cached_tokens"] or 0)
    result.success = result.ttft is not None
    if not result.success:
        result.error = "the stream ended without a completion chunk"
    return result


async def accepts_token_ids(client: httpx.AsyncClient, target: CompletionTarget) -> bool:
    """Whether the server takes `prompt: [ids]`: one tiny non-streaming request.

    Raises ValueError when the answer says the request could never succeed (wrong route,
    model or key), rather than sending every request to fail the same way.
    """
    probe = [TOKEN_PROBE_ID] * 4
    response = await client.post(
        target.url, json=target.body(probe, 1, stream=False), headers=target.headers
    )
    if response.status_code in (401, 403, 404):
        raise ValueError(
            f"POST {target.url} answered {response.status_code} (check --base-url, --endpoint, "
            f"--model and --api-key): {response.text[:300]}"
        )
    return response.status_code == 200


async def served_model_name(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """The first model GET /v1/models lists."""
    response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    if response.status_code != 200:
        raise ValueError(
            f"GET /v1/models answered {response.status_code}; pass --model. {response.text[:300]}"
        )
    models = response.json().get("data") or []
    if not models:
        raise ValueError("GET /v1/models lists no model; pass --model.")
    return str(models[0]["id"])


async def server_counters(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str]
) -> dict[str, float] | None:
    """Prefix-cache and preemption counters from GET /metrics (vLLM's names, any prefix).

    tokenserve exports `tokenserve:prefix_cache_hits_total`, vLLM `vllm:...`; llama-server
    has none of them. None when the route is missing or lists none.
    """
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    wanted = ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions")
    counters: dict[str, float] = {}
    for line in response.text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.partition("{")[0].rpartition(":")[2].removesuffix("_total")
        if name in wanted:
            try:
                counters[name] = counters.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return counters or None


_SSE_LINE_END = re.compile(r"\r\n|\n|\r")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """A streamed response's lines as server-sent events define them: ended by CR LF, LF
    or CR only. (httpx's aiter_lines also ends a line at U+2028, U+0085 and the like, which
    a server may leave raw inside an event's JSON.) A CR LF split across two chunks reads
    as an extra empty line, which carries no data."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = _SSE_LINE_END.split(pending + text)
        for line in lines:
            yield line
    if pending:
        yield pending


def _sse_data(line: str) -> str | None:
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()
