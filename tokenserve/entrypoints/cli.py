"""The `tokenserve` command line.

This module imports only argparse-level code: `tokenserve serve` starts its engine-core
process first thing (which imports this module again, as multiprocessing's spawn does), and
each subcommand imports what it runs when it runs (docs/STARTUP.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenserve.engine.core_process import EngineCoreProcess


def _run_chat(args: argparse.Namespace) -> int:
    from tokenserve.engine.cli_args import engine_args_from
    from tokenserve.entrypoints.llm import LLM
    from tokenserve.sampling_params import SamplingParams

    llm = LLM(**vars(engine_args_from(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    messages = [{"role": "user", "content": args.message}]
    [output] = llm.chat(messages, params, use_tqdm=False)
    print(output.outputs[0].text)
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from tokenserve.engine.cli_args import engine_args_from
    from tokenserve.entrypoints.llm import LLM
    from tokenserve.sampling_params import SamplingParams

    llm = LLM(**vars(engine_args_from(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for output in llm.generate(args.prompt, params, use_tqdm=False):
        print(output.outputs[0].text)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from tokenserve.engine.cli_args import engine_args_from

    engine_args = engine_args_from(args)
    engine_process: EngineCoreProcess | None = getattr(args, "engine_process", None)
    if engine_process is not None and engine_args.data_parallel_size > 1:
        # Several engines, each started pinned to its own cores (engine/dp_client.py).
        engine_process.shutdown()
        engine_process = None
    if engine_process is not None:
        # It builds its configuration and loads the model while this process builds the
        # same configuration (flags checked here: a ValueError is exit code 2) and imports
        # the HTTP stack below; the ready handshake checks that the two agree.
        engine_process.configure_from_args(engine_args)
        engine_process.configure(engine_args.create_engine_config())
    from tokenserve.entrypoints.openai.api_server import run_server

    return asyncio.run(run_server(args, engine_args, engine_process))


def _offline_llm(**engine_kwargs: Any) -> Any:
    """The offline engine `bench throughput` measures, imported when it runs."""
    from tokenserve.entrypoints.llm import LLM

    return LLM(**engine_kwargs)


def _calibration_app(engine):
    """The OpenAI app `tokenserve calibrate` serves its rounds through (as `serve` would)."""
    from tokenserve.entrypoints.openai.api_server import build_app
    from tokenserve.simulator.calibrate import CALIBRATION_MODEL_NAME

    return build_app(engine, [CALIBRATION_MODEL_NAME])


def _size(value: str) -> int:
    from tokenserve.engine.engine_args import parse_memory

    try:
        size = parse_memory(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes or a size like '4MiB', got {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {value!r}")
    return size


def _bool(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """HTTP server flags, with vLLM's names where vLLM has the flag."""
    from tokenserve.entrypoints.chat_utils import CONTENT_FORMAT_OPTIONS
    from tokenserve.entrypoints.openai.limits import ServingLimits
    from tokenserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from tokenserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from tokenserve.multimodal.media_security import MediaConnectorConfig

    limits = ServingLimits()
    media = MediaConnectorConfig()
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument("--api-key", action="append", default=None,
                        help="Require 'Authorization: Bearer <key>' on every route but /health "
                             "and /metrics. Repeat for several keys (tenants). Visible to local "
                             "users in the process list: prefer --api-key-file.")
    parser.add_argument("--api-key-file", default=None,
                        help="A file of API keys, one per line (blank lines and # comments "
                             "skipped); adds to --api-key.")
    parser.add_argument("--shared-prefix-cache-across-keys", action="store_true",
                        help="Let requests under different API keys share prefix-cache blocks "
                             "(by default each key gets its own cache salt).")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) the API answers to (default: the model argument, or "
                             "SmolLM2-135M-Instruct for the default model); the first one is "
                             "reported in responses and metrics.")
    parser.add_argument("--chat-template", default=None,
                        help="Chat template (a file, or jinja2 text) to use instead of the model's.")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="Accept a chat_template in requests (jinja2 run by the server); "
                             "refused with 400 by default.")
    parser.add_argument("--chat-template-content-format", default="auto",
                        choices=CONTENT_FORMAT_OPTIONS,
                        help="How message content reaches the chat template: 'string' (text "
                             "parts joined, an image placeholder per image), 'openai' (the list "
                             "of parts), or 'auto' (detected from the template).")
    parser.add_argument("--allowed-media-domains", nargs="+", default=None,
                        help="Hosts image URLs may name (exact names, checked on every "
                             "redirect); by default any public host (docs/MEDIA_SECURITY.md).")
    parser.add_argument("--allowed-media-networks", nargs="+", default=[],
                        help="Non-public networks (CIDR, e.g. 10.1.2.0/24) image URLs may reach; "
                             "loopback, private, link-local and other non-public addresses are "
                             "refused otherwise.")
    parser.add_argument("--allowed-local-media-path", default=None,
                        help="A directory file: image URLs may read under (symlinks resolved); "
                             "file: URLs are refused without it.")
    parser.add_argument("--media-fetch-timeout", type=float, default=media.media_fetch_timeout,
                        help="Seconds one image URL may take (DNS, redirects and body).")
    parser.add_argument("--max-media-bytes", type=_size, default=media.max_media_bytes,
                        help="Largest image, in bytes (or e.g. '20MiB'), fetched or in a data: URL.")
    parser.add_argument("--max-image-pixels", type=int, default=media.max_image_pixels,
                        help="Most pixels (width x height) of an image, read before decoding.")
    parser.add_argument("--max-media-redirects", type=int, default=media.max_media_redirects,
                        help="Most HTTP redirects one image URL may take.")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='Serve tool_choice "auto" (the default when a request has tools): '
                             "read tool calls out of the output with --tool-call-parser.")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="How the model writes tool calls (for --enable-auto-tool-choice).")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="Split the model's reasoning into reasoning_content (chat).")
    parser.add_argument("--structured-outputs-config.enable_in_reasoning",
                        dest="structured_outputs_enable_in_reasoning", type=_bool, nargs="?", metavar="BOOL",
                        const=True, default=False,
                        help="With --reasoning-parser, let structured outputs constrain the "
                             "reasoning too (by default only what follows it).")
    parser.add_argument("--max-waiting-requests", type=int, default=limits.max_waiting_requests,
                        help="Sequences (prompts x n) that may wait beyond --max-num-seqs "
                             "running ones; past that, requests get 503 with Retry-After.")
    parser.add_argument("--max-request-body-size", type=_size, default=limits.max_request_body_size,
                        help="Largest request body (bytes or e.g. '4MiB'); larger ones get 413.")
    parser.add_argument("--h11-max-incomplete-event-size", type=_size, default=limits.max_header_size,
                        help="Largest header block, in bytes: one still arriving past it gets 400 "
                             "(h11) and its connection is closed; a complete one gets 431.")
    parser.add_argument("--h11-max-header-count", type=int, default=limits.max_header_count,
                        help="Most request headers; more get 431.")
    parser.add_argument("--max-n", type=int, default=limits.max_n,
                        help="Largest n (samples per prompt) a request may ask for.")
    parser.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings,
                        help="Most stop strings in one request.")
    parser.add_argument("--max-stop-string-length", type=int, default=limits.max_stop_string_length,
                        help="Longest stop string, in characters.")
    parser.add_argument("--lora-modules", nargs="+", default=None,
                        help="LoRA adapters to serve (with --enable-lora): name=path, or JSON "
                             '\'{"name": ..., "path": ..., "base_model_name": ...}\'. A request\'s '
                             "model picks one by name.")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING), behind the API key.")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="On SIGINT/SIGTERM, seconds in-flight requests get to finish before "
                             "they are cut off.")
    parser.add_argument("--request-trace", default=None, metavar="FILE",
                        help="Record served requests to FILE as a Mooncake trace (arrival ms, "
                             "lengths, 512-token block-hash ids; never text), for "
                             "bench serve --dataset mooncake and tokenserve simulate.")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="Do not log throughput, queue and KV cache stats every 5 s.")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="Log level of the HTTP server.")


def build_parser(serve_only: bool = False) -> argparse.ArgumentParser:
    """The command line; `serve_only`: just `serve`, for a server starting (its start waits on
    these imports, docs/STARTUP.md)."""
    from tokenserve.engine.cli_args import add_engine_arguments

    parser = argparse.ArgumentParser(prog="tokenserve", description="LLM inference and serving engine.")
    subcommands = parser.add_subparsers(dest="command", required=True)

    serve = subcommands.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                    "/version, /metrics). The engine core runs in its own process.",
    )
    add_engine_arguments(serve, positional_model=True)
    add_server_arguments(serve)
    serve.set_defaults(handler=_run_serve)
    if serve_only:
        return parser

    chat = subcommands.add_parser("chat", help="Answer one chat message offline and print the reply.")
    chat.add_argument("message", help="The user message.")
    generate = subcommands.add_parser("generate", help="Complete prompts offline and print the completions.")
    generate.add_argument("--prompt", action="append", required=True, help="A prompt (repeatable).")
    for sub, runner in ((chat, _run_chat), (generate, _run_generate)):
        add_engine_arguments(sub, positional_model=False)
        sub.add_argument("--temperature", type=float, default=0.0, help="0 for greedy.")
        sub.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
        sub.set_defaults(handler=runner)

    from tokenserve.benchmarks.commands import add_bench_parser
    from tokenserve.entrypoints.disagg_proxy import add_proxy_parser
    from tokenserve.simulator.commands import add_diagnosis_parsers

    add_bench_parser(subcommands, _offline_llm)
    add_proxy_parser(subcommands)
    add_diagnosis_parsers(subcommands, _calibration_app)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    engine_process = _prestart_engine_process(argv)
    try:
        args = build_parser(serve_only=engine_process is not None).parse_args(argv)
        args.engine_process = engine_process
        return args.handler(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if engine_process is not None:
            engine_process.shutdown()


def _prestart_engine_process(argv: list[str]) -> Any:
    """For `serve`: the engine-core process, started before anything heavy is imported here,
    so that both processes import their stacks at once (it waits for its configuration)."""
    if argv[:1] != ["serve"] or any(flag in argv for flag in ("-h", "--help")):
        return None
    from tokenserve.engine.core_process import EngineCoreProcess

    return EngineCoreProcess()


if __name__ == "__main__":
    sys.exit(main())
