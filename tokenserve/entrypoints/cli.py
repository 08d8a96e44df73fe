"""The `tokenserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenserve.config import PREFILL_ORDERS
from tokenserve.engine.engine_args import KV_CACHE_DTYPES, EngineArgs, parse_memory

MODEL_HELP = "Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct)."


def add_engine_arguments(parser: argparse.ArgumentParser, positional_model: bool) -> None:
    """Engine flags, with vLLM's names."""
    defaults = EngineArgs()
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    else:
        parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--tokenizer", default=None, help="Tokenizer directory, if not the model's own.")
    parser.add_argument("--dtype", default=defaults.dtype,
                        help="auto (float32 on CPU), float32, bfloat16 or float16.")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="Random seed.")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="Longest prompt + output in tokens (default: the model's own limit).")
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help="Token budget of one engine step (default: 512 with chunked prefill, "
                             "else max(max_model_len, 512)).")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="Most requests running at once.")
    parser.add_argument("--block-size", type=int, default=defaults.block_size,
                        help="Tokens per KV cache block (default 128, as vLLM on CPU).")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache size: bytes or e.g. '4GiB' (default 4GiB on CPU).")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
                        default=defaults.kv_cache_dtype,
                        help="What the KV cache stores: 'auto' (the model's dtype) or "
                             "'bfloat16' (half a float32 cache's bytes: twice the tokens in "
                             "--kv-cache-memory and less to read each decode step; keys and "
                             "values rounded to 8 significant bits).")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="Number of KV cache blocks (overrides --kv-cache-memory).")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_prefix_caching, help="Reuse KV of shared prefixes.")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_chunked_prefill,
                        help="Split long prompts across steps.")
    parser.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs,
                        help="Most logprobs (and prompt logprobs) a request may ask for.")
    parser.add_argument("--disable-cascade-attn", action="store_true",
                        default=defaults.disable_cascade_attn,
                        help="Attend each prefill chunk over its whole context alone, instead "
                             "of a long prefix shared by several chunks once for all of them.")
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                        default=defaults.scheduling_policy, help="Order of admission and preemption.")
    parser.add_argument("--prefill-order", choices=list(PREFILL_ORDERS),
                        default=defaults.prefill_order,
                        help="Which prompts get a step's tokens once every decode has its token: "
                             "'shortest' remaining prompt first (a short request is not stuck "
                             "behind a long one; equal lengths stay first come first served) or "
                             "'arrival' (started prompts, then the waiting queue). Under "
                             "--scheduling-policy priority, prompts always go in priority order.")
    parser.add_argument("--admission-lookahead-tokens", type=int,
                        default=defaults.admission_lookahead_tokens,
                        help="Admit a request only if the running requests and it fit the KV "
                             "cache over their next this many tokens (each bounded by its "
                             "max_tokens; a finished request frees its blocks): fewer "
                             "preemptions when the cache is full. 0: admit whenever the prompt "
                             "fits.")
    parser.add_argument("--target-step-ms", type=float, default=defaults.target_step_ms,
                        help="Target engine-step time in ms: each step's prompt tokens are sized "
                             "from the measured step cost to keep it within the target (every "
                             "decode still gets its token; prefill gets at least 16 tokens a step). "
                             "Default: no target, --max-num-batched-tokens alone limits a step.")


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    values = {name: getattr(namespace, name) for name in EngineArgs.field_names() if hasattr(namespace, name)}
    return EngineArgs(**values)


def _run_chat(args: argparse.Namespace) -> int:
    from tokenserve import LLM, SamplingParams

    llm = LLM(**vars(engine_args_from(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    messages = [{"role": "user", "content": args.message}]
    [output] = llm.chat(messages, params, use_tqdm=False)
    print(output.outputs[0].text)
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from tokenserve import LLM, SamplingParams

    llm = LLM(**vars(engine_args_from(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for output in llm.generate(args.prompt, params, use_tqdm=False):
        print(output.outputs[0].text)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from tokenserve.entrypoints.openai.api_server import run_server

    return asyncio.run(run_server(args, engine_args_from(args)))


def _size(value: str) -> int:
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
    from tokenserve.entrypoints.openai.limits import ServingLimits
    from tokenserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from tokenserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

    limits = ServingLimits()
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
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="On SIGINT/SIGTERM, seconds in-flight requests get to finish before "
                             "they are cut off.")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="Do not log throughput, queue and KV cache stats every 5 s.")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="Log level of the HTTP server.")


def build_parser() -> argparse.ArgumentParser:
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

    chat = subcommands.add_parser("chat", help="Answer one chat message offline and print the reply.")
    chat.add_argument("message", help="The user message.")
    generate = subcommands.add_parser("generate", help="Complete prompts offline and print the completions.")
    generate.add_argument("--prompt", action="append", required=True, help="A prompt (repeatable).")
    for sub, runner in ((chat, _run_chat), (generate, _run_generate)):
        add_engine_arguments(sub, positional_model=False)
        sub.add_argument("--temperature", type=float, default=0.0, help="0 for greedy.")
        sub.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
        sub.set_defaults(handler=runner)

    from tokenserve.benchmarks.commands import add_bench_parser  # it uses this module's helpers

    add_bench_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
