"""The engine's command-line flags (vLLM's names) and the EngineArgs they give.

Shared by the `tokenserve` subcommands that run an engine (entrypoints/cli.py) and by
`tokenserve bench throughput` (benchmarks/commands.py).
"""

from __future__ import annotations

import argparse

from tokenserve.config import CPU_ISAS, DISTRIBUTED_EXECUTOR_BACKENDS, PREFILL_ORDERS
from tokenserve.engine.engine_args import KV_CACHE_DTYPES, EngineArgs
from tokenserve.kv_transfer.config import parse_kv_transfer_config_json
from tokenserve.spec_decode.config import parse_speculative_config_json

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
                        help="auto (bfloat16 on CPUs with AVX512_BF16 or AMX, else float32), "
                             "float32, bfloat16 or float16.")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="Random seed.")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="Longest prompt + output in tokens (default: the model's own limit).")
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help="Token budget of one engine step (default with chunked prefill: 1024 "
                             "in float32, 2048 in bfloat16 or float16; without it at least "
                             "max_model_len).")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="Most requests running at once.")
    parser.add_argument("--block-size", type=int, default=defaults.block_size,
                        help="Tokens per KV cache block (default 128, as vLLM on CPU).")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache size: bytes or e.g. '4GiB' (default 4GiB on CPU).")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
                        default=defaults.kv_cache_dtype,
                        help="What the KV cache stores: 'auto' (the model's dtype), "
                             "'bfloat16' (half a float32 cache's bytes: twice the tokens in "
                             "--kv-cache-memory and less to read each decode step; keys and "
                             "values rounded to 8 significant bits), or 'fp8' (= 'fp8_e4m3') "
                             "or 'fp8_e5m2': 8-bit floats, a quarter of float32's bytes, "
                             "4 or 3 significant bits, saturated at 448 or 57344.")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="Number of KV cache blocks (overrides --kv-cache-memory).")
    parser.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction,
                        default=defaults.kv_cache_prefault,
                        help="Fault the CPU KV cache's memory in while the server is idle, "
                             "ahead of use, so that steps do not (default on; the cache "
                             "then becomes resident whole). Off: each page on first use.")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_prefix_caching, help="Reuse KV of shared prefixes.")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_chunked_prefill,
                        help="Split long prompts across steps.")
    parser.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs,
                        help="Most logprobs (and prompt logprobs) a request may ask for.")
    parser.add_argument("--disable-cascade-attn", action="store_true",
                        default=defaults.disable_cascade_attn,
                        help="Attend each prefill chunk and decode row over its whole context "
                             "alone, instead of a long prefix shared by several of them once "
                             "for all of them.")
    parallel = parser.add_argument_group("Parallelism (docs/PARALLELISM.md)")
    parallel.add_argument("-tp", "--tensor-parallel-size", type=int,
                          default=defaults.tensor_parallel_size,
                          help="Ranks each layer is split over (heads, MLP rows, vocabulary).")
    parallel.add_argument("-pp", "--pipeline-parallel-size", type=int,
                          default=defaults.pipeline_parallel_size,
                          help="Pipeline stages the layers are split over.")
    parallel.add_argument("--distributed-executor-backend", choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
                          default=defaults.distributed_executor_backend,
                          help="What runs the ranks: uni (one process), mp (a process per "
                               "rank), ray (Ray actors; pip install tokenserve[ray]). Default: "
                               "uni for one rank, else mp.")
    kernels = parser.add_argument_group("CPU kernels (all on by default)")
    kernels.add_argument("--disable-c-kernels", action="store_true",
                         default=defaults.disable_c_kernels,
                         help="Use pure-torch code instead of tokenserve's C kernels (paged "
                              "decode attention, norms, rotary, GGUF block products, the fused "
                              "decode layer).")
    kernels.add_argument("--disable-onednn", action="store_true",
                         default=defaults.disable_onednn,
                         help="Multiply by dense weights with F.linear instead of oneDNN's "
                              "prepacked ones.")
    kernels.add_argument("--disable-fused-decode", action="store_true",
                         default=defaults.disable_fused_decode,
                         help="Run a step of few rows (decode rows, prompt chunks on the "
                              "prompt-attention kernel) operator by operator instead of each "
                              "decoder layer as one C call (the same results).")
    kernels.add_argument("--weight-huge-pages", action=argparse.BooleanOptionalAction,
                         default=defaults.weight_huge_pages,
                         help="Move the model's weights onto 2 MiB pages while the server is "
                              "idle (Linux 6.1 and later; default on): fewer TLB misses in "
                              "steps of few rows, which read all of them.")
    kernels.add_argument("--quantized-max-rows", type=int, default=defaults.quantized_max_rows,
                         help="GGUF models: products of at most this many rows read the "
                              "weights' blocks with the few-row kernel (0: off).")
    kernels.add_argument("--quantized-gemm-max-rows", type=int,
                         default=defaults.quantized_gemm_max_rows,
                         help="GGUF models: products of more rows, up to this many, read the "
                              "blocks with the many-row kernel; oneDNN above (0: off).")
    kernels.add_argument("--bf16-quantized-max-rows", type=int,
                         default=defaults.bf16_quantized_max_rows,
                         help="GGUF models in bfloat16: products of at most this many rows "
                              "read the blocks (on the amx level from 4 rows through the AMX "
                              "block kernel, on avx512_bf16 through the vdpbf16ps one, both "
                              "with bf16 numerics; else the float32 ones, within the two "
                              "limits above), more rows go to oneDNN's bf16 GEMM. Default: "
                              "1024 on amx, 128 on avx512_bf16, 16 on other levels.")
    kernels.add_argument("--int8-activation-max-rows", type=int,
                         default=defaults.int8_activation_max_rows,
                         help="GGUF models: products of at most this many rows multiply the "
                              "blocks by x rounded to 8 bits per 32-value block, as llama.cpp "
                              "does (x86-64 levels; 0: never). "
                              "Default: 4 for a bfloat16 model, 0 for a float32 one.")
    kernels.add_argument("--batch-invariant", action="store_true",
                         default=defaults.batch_invariant,
                         help="A request's greedy tokens independent of the batch it runs in: "
                              "every product on the AMX block kernel (a GGUF model in bfloat16 "
                              "on the amx level; refused elsewhere). Slower prompt steps: "
                              "keep --max-num-batched-tokens small (e.g. 256).")
    kernels.add_argument("--cpu-isa", choices=list(CPU_ISAS), default=defaults.cpu_isa,
                         help="Instruction set the C kernels are built for: auto (the best the "
                              "CPU has) or a lower level forced (docs/PERFORMANCE_CPU.md).")
    parser.add_argument("--runner", choices=["auto", "generate", "pooling"],
                        default=defaults.runner,
                        help="'generate' samples tokens; 'pooling' serves embeddings, scores and "
                             "classes (/v1/embeddings, /score, /rerank, /classify); 'auto' "
                             "picks by the architecture (BertModel, *ForSequenceClassification: "
                             "pooling).")
    parser.add_argument("--pooler-config", default=None,
                        help="Pooling runner: JSON overriding the model's pooling, e.g. "
                             "'{\"pooling_type\": \"MEAN\", \"normalize\": false}'.")
    lora = parser.add_argument_group("LoRA adapters (docs/LORA.md)")
    lora.add_argument("--enable-lora", action="store_true", default=defaults.enable_lora,
                      help="Serve LoRA adapters (PEFT directories) over the base model, several "
                           "in one batch.")
    lora.add_argument("--max-loras", type=int, default=defaults.max_loras,
                      help="Most distinct adapters in one batch (each takes a slot in the layers).")
    lora.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank,
                      help="Largest adapter rank accepted.")
    lora.add_argument("--max-cpu-loras", type=int, default=defaults.max_cpu_loras,
                      help="Adapters kept loaded in memory, least recently used dropped first "
                           "(default: --max-loras).")
    parser.add_argument("--limit-mm-per-prompt", default=None,
                        help='Vision-language models: the most images one prompt may hold, as '
                             'JSON, e.g. \'{"image": 2}\' (default 999).')
    parser.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                        help="Vision-language models: image encoder output tokens one step may "
                             "compute (default: --max-num-batched-tokens).")
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                        default=defaults.scheduling_policy, help="Order of admission and preemption.")
    parser.add_argument("--prefill-order", choices=list(PREFILL_ORDERS),
                        default=defaults.prefill_order,
                        help="Which prompts get a step's tokens once every decode has its token: "
                             "'shortest' remaining prompt first (a short request is not stuck "
                             "behind a long one; equal lengths stay first come first served) or "
                             "'arrival' (started prompts, then the waiting queue). Under "
                             "--scheduling-policy priority, prompts always go in priority order.")
    parser.add_argument("--oldest-prompt-share", type=float,
                        default=defaults.oldest_prompt_share,
                        help="Under --prefill-order shortest: the share of each step's prompt "
                             "tokens (what its decode rows leave) held for the running prompt "
                             "that arrived first, so that short requests arriving one after "
                             "another do not hold a long prompt back; 0: none held.")
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
                             "decode still gets its token; prefill gets at least 16 tokens a step; "
                             "a step that would leave a waiting request without a token takes the "
                             "full --max-num-batched-tokens). Default: no target, "
                             "--max-num-batched-tokens alone limits a step.")
    parser.add_argument("--long-prefill-token-threshold", type=int,
                        default=defaults.long_prefill_token_threshold,
                        help="The most tokens of one prompt a step computes while other "
                             "requests run or wait: a longer prompt is spread over steps "
                             "(chunked prefill), so the steps that carry it delay the running "
                             "decodes less, at some cost to its own time to first token. 0 "
                             "(default): no limit beyond --max-num-batched-tokens.")
    parser.add_argument("-dp", "--data-parallel-size", type=int,
                        default=defaults.data_parallel_size,
                        help="Engine cores behind one API server, each with its own KV cache "
                             "and the CPU cores split between them; requests are routed to the "
                             "least loaded one, requests sharing a prefix to the same one "
                             "(tokenserve serve only).")
    parser.add_argument("--speculative-config", type=_speculative_config, default=None,
                        help='Speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
                             '\'{"method": "draft_model", "model": PATH, '
                             '"num_speculative_tokens": 4}\'; "disable_by_batch_size": N '
                             "speculates only while at most N requests run.")
    parser.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None,
                        help='A KV connector as JSON, vLLM\'s keys (docs/KV_CONNECTORS.md): '
                             '\'{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '
                             '"kv_connector_extra_config": {"shared_storage_path": DIR, '
                             '"max_size_gb": 10}}\'.')
    parser.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                        help="GiB of host memory for a second pool of KV blocks behind the "
                             "KV cache: computed blocks are copied there and come back on a "
                             "prefix-cache miss instead of being recomputed (OffloadingConnector).")


def _kv_transfer_config(text: str) -> dict:
    try:
        return parse_kv_transfer_config_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _speculative_config(text: str) -> dict:
    try:
        return parse_speculative_config_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    values = {name: getattr(namespace, name) for name in EngineArgs.field_names() if hasattr(namespace, name)}
    return EngineArgs(**values)
