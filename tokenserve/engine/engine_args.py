"""User-facing engine arguments and their resolution into an EngineConfig.

Names follow vLLM's engine arguments. Everything is validated here, before any model
weight is read, so that a bad setting fails fast with a ValueError that names it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, fields

from tokenserve.config import (
    DEFAULT_LOOKAHEAD_TOKENS,
    DEFAULT_OLDEST_PROMPT_SHARE,
    DEFAULT_QUANTIZED_GEMM_MAX_ROWS,
    DEFAULT_QUANTIZED_MAX_ROWS,
    PREFILL_ORDERS,
    CacheConfig,
    EngineConfig,
    KernelConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenserve.engine.parallel_checks import check_parallel_model
from tokenserve.engine.runner_config import RunnerSettings, configure_runner
from tokenserve.kv_transfer.config import kv_transfer_config_for
from tokenserve.model.dtype_names import resolve_dtype_name
from tokenserve.model.loader import MULTIMODAL_ARCHITECTURES, resolve_model
from tokenserve.spec_decode.config import create_speculative_config

logger = logging.getLogger(__name__)

# CPU default for the KV cache, as vLLM's CPU backend uses: comfortable on a 24 GiB machine.
DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 1024**3

# --kv-cache-dtype values (vLLM's names) → what the cache stores (a name of
# config.DTYPE_SIZES); "auto": the model's dtype. fp8 is E4M3, as in vLLM.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "fp8": "float8_e4m3fn",
                   "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_MEMORY_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
                 "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int or a string such as '4GiB', '512MiB', '2e9'."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(f"kv_cache_memory must be bytes or a size like '4GiB', got {value!r}.")
    return int(float(match.group(1)) * _MEMORY_UNITS[unit])


def parse_limit_mm_per_prompt(value: dict | str | None) -> dict[str, int]:
    """--limit-mm-per-prompt: {"image": N} (or its JSON) → {modality: limit}, checked."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"limit_mm_per_prompt must be JSON such as '{{\"image\": 2}}': {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must map modalities to counts, got {value!r}.")
    limits = {}
    for modality, limit in value.items():
        if modality not in ("image",):
            raise ValueError(f"limit_mm_per_prompt: unsupported modality {modality!r}; supported: 'image'.")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer, got {limit!r}.")
        limits[modality] = limit
    return limits


# A step's token budget on CPU, by the dtype the products run in. bf16 (oneDNN on AMX, the
# GGUF blocks' AMX kernel): larger steps pay, W1 ran 6-9 % faster at 2048 than at 1024 and
# faster than at 4096 or 8192, vLLM's budget for its CPU server. float32: a prompt step's
# throughput is flat from 1024 tokens, and a step half as long halves what every running
# decode waits for (W2's ITL p99 on an AVX2 host). docs/benchmarks/cpu-hot-path.md,
# "Defaults". Lower it (or set --target-step-ms) to bound the step further.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"float32": 1024, "bfloat16": 2048, "float16": 2048}

# Tokens per KV block on CPU, as vLLM's CPU backend defaults to: a decode row's context is
# read in runs of block_size tokens per kv head, and longer runs stream faster from memory
# (docs/benchmarks/cpu-hot-path.md). Prefix caching reuses whole blocks only;
# --block-size 16 reuses shorter shared prefixes.
DEFAULT_BLOCK_SIZE = 128

@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # None: DEFAULT_MAX_NUM_BATCHED_TOKENS[dtype] with chunked prefill, else at least the
    # longest prompt.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | str | None = None
    # "auto": the model's dtype; "bfloat16": half the bytes of a float32 model's cache
    # (twice the tokens in the same memory, less to read per decode step).
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None
    # A CPU cache's pages faulted in while the engine core is idle, ahead of their first
    # use; False: each on first use only (the resident memory then grows with use).
    kv_cache_prefault: bool = True
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # Which prompts get a step's tokens after its decode rows: "shortest" remaining
    # prompt first, or by "arrival" (fcfs policy only; priority order under "priority").
    prefill_order: str = "shortest"
    # Under "shortest": the share of each step's prompt tokens held for the running prompt
    # that arrived first (a long prompt advances while short ones keep arriving); 0: none.
    oldest_prompt_share: float = DEFAULT_OLDEST_PROMPT_SHARE
    # Admit a request only if the running requests and it fit the KV cache over their next
    # this many tokens of growth; 0: whenever its prompt fits (fewer preemptions vs. more
    # requests at once under KV pressure).
    admission_lookahead_tokens: int = DEFAULT_LOOKAHEAD_TOKENS
    # Size each step's prefill from the measured step cost so steps stay within this
    # many milliseconds (decodes always advance); None: no target.
    target_step_ms: float | None = None
    # The most tokens of one prompt a step computes while other requests run or wait, so a
    # long prompt is spread over steps beside the running decodes (vLLM's name); 0: no
    # limit beyond the step's budget.
    long_prefill_token_threshold: int = 0
    # The most logprobs / prompt_logprobs a request may ask for (vLLM's default).
    max_logprobs: int = 20
    # Prefill chunks that share a long cached prefix attend to it in one call (cascade
    # attention); True: each chunk attends to its whole context alone.
    disable_cascade_attn: bool = False
    # Parallelism (docs/PARALLELISM.md): tensor-parallel ranks per pipeline stage, pipeline
    # stages, and what runs the ranks' workers (executor/): "uni" (one worker in the engine
    # core's process), "mp" (a process per rank) or "ray"; None: uni for one rank, else mp.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # Engine cores behind one API server (`tokenserve serve` only; docs/PARALLELISM.md).
    data_parallel_size: int = 1
    # The CPU fast paths (config.KernelConfig): off switches for comparison, and the row
    # limits of the GGUF block kernels.
    disable_c_kernels: bool = False
    disable_onednn: bool = False
    disable_fused_decode: bool = False
    quantized_max_rows: int = DEFAULT_QUANTIZED_MAX_ROWS
    quantized_gemm_max_rows: int = DEFAULT_QUANTIZED_GEMM_MAX_ROWS
    bf16_quantized_max_rows: int | None = None  # None: by level (KernelConfig)
    batch_invariant: bool = False  # KernelConfig.batch_invariant
    weight_huge_pages: bool = True  # KernelConfig.weight_huge_pages
    int8_activation_max_rows: int | None = None  # None: by dtype (KernelConfig)
    # The C kernels' instruction set (kernels/cpu_isa.py): "auto" or a lower level forced.
    cpu_isa: str = "auto"
    # vLLM's --runner: "generate", "pooling" (embeddings, scores, classes) or "auto" (by
    # the architecture); --pooler-config overrides the pooling ({"pooling_type", "normalize"}).
    runner: str = "auto"
    pooler_config: dict | str | None = None
    # Multi-LoRA (docs/LORA.md): adapters in one step (max_loras), the largest rank, and
    # adapters kept loaded (max_cpu_loras; None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (vLLM's keys): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": .., "prompt_lookup_max": ..} or {"method": "draft_model",
    # "model": path, "num_speculative_tokens": k}, and "disable_by_batch_size" (spec_decode/).
    speculative_config: dict | None = None
    # Vision-language models (docs/MULTIMODAL.md): the most images one prompt may hold,
    # {"image": N} or its JSON (vLLM's; 999 by default), and the image encoder output
    # tokens one step may compute (None: max_num_batched_tokens).
    limit_mm_per_prompt: dict | str | None = None
    max_num_encoder_input_tokens: int | None = None
    # Image encoder output tokens the encoder cache holds (None: max_num_encoder_input_tokens,
    # as vLLM; an image larger than the cache still fits an empty one).
    encoder_cache_size: int | None = None
    # A KV connector (vLLM's keys, docs/KV_CONNECTORS.md): {"kv_connector":
    # "SharedStorageConnector", "kv_role": "kv_both", "kv_connector_extra_config":
    # {"shared_storage_path": DIR}}; a JSON string or a dict.
    kv_transfer_config: dict | str | None = None
    # GiB of host memory for a second pool of KV blocks behind the main cache (vLLM's
    # --kv-offloading-size; the OffloadingConnector); None: off.
    kv_offloading_size: float | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        self._validate_numbers()
        self._lora_config()  # LoRA settings fail before any weight is read
        parallel_config = ParallelConfig(
            self.distributed_executor_backend, self.tensor_parallel_size,
            self.pipeline_parallel_size, data_parallel_size=self.data_parallel_size,
        )
        kernel_config = KernelConfig(
            disable_c_kernels=self.disable_c_kernels,
            disable_onednn=self.disable_onednn,
            disable_fused_decode=self.disable_fused_decode,
            quantized_max_rows=self.quantized_max_rows,
            quantized_gemm_max_rows=self.quantized_gemm_max_rows,
            bf16_quantized_max_rows=self.bf16_quantized_max_rows,
            batch_invariant=self.batch_invariant,
            int8_activation_max_rows=self.int8_activation_max_rows,
            cpu_isa=self.cpu_isa,
            weight_huge_pages=self.weight_huge_pages,
        )
        files = resolve_model(self.model)
        hf_config = files.hf_config
        model_config = ModelConfig(
            model=files.path,
            format=files.format,
            architecture=files.architecture,
            hf_config=hf_config,
            dtype=resolve_dtype_name(self.dtype, kernel_config.cpu_isa),
            max_model_len=self._resolve_max_model_len(getattr(hf_config, "text_config", None) or hf_config),
            files=files,
            tokenizer=self.tokenizer,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            disable_cascade_attn=self.disable_cascade_attn,
            multimodal_config=self._multimodal_config(files.architecture),
        )
        settings = configure_runner(
            model_config,
            self.runner,
            self.pooler_config,
            RunnerSettings(self.enable_chunked_prefill, self.enable_prefix_caching),
        )
        enable_chunked_prefill = settings.enable_chunked_prefill

        speculative_config = create_speculative_config(self.speculative_config, model_config)
        check_parallel_model(parallel_config, model_config, self, speculative_config)
        cache_dtype = self._resolve_kv_cache_dtype(model_config.dtype)
        num_blocks = self._resolve_num_blocks(
            model_config, cache_dtype, speculative_config, parallel_config
        )
        capacity = num_blocks * self.block_size
        if model_config.max_model_len > capacity:
            if self.max_model_len is not None:
                raise ValueError(
                    f"max_model_len={self.max_model_len} does not fit in the KV cache "
                    f"({num_blocks} blocks of {self.block_size} = {capacity} tokens); "
                    "raise kv_cache_memory / num_kv_blocks or lower max_model_len."
                )
            logger.warning("Lowering max_model_len to %d: the KV cache holds no more.", capacity)
            model_config.max_model_len = capacity

        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS[model_config.dtype]
            if not enable_chunked_prefill:
                max_num_batched_tokens = max(model_config.max_model_len, max_num_batched_tokens)
        if not enable_chunked_prefill and max_num_batched_tokens < model_config.max_model_len:
            raise ValueError(
                f"With chunked prefill disabled, max_num_batched_tokens ({max_num_batched_tokens}) "
                f"must be at least max_model_len ({model_config.max_model_len}), or a long prompt "
                "could never be scheduled."
            )
        if self.long_prefill_token_threshold > 0 and not enable_chunked_prefill:
            raise ValueError(
                "long_prefill_token_threshold splits prompts over steps: it needs chunked "
                "prefill, which is disabled here."
            )
        if self.long_prefill_token_threshold > model_config.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) is more "
                f"than max_model_len ({model_config.max_model_len}): no prompt is that long."
            )
        if self.batch_invariant:
            # Every product of a step on the blocks' kernel: its rows at most the budget.
            if self.bf16_quantized_max_rows is None:
                kernel_config.bf16_quantized_max_rows = max_num_batched_tokens
            elif self.bf16_quantized_max_rows < max_num_batched_tokens:
                raise ValueError(
                    f"batch_invariant needs bf16_quantized_max_rows "
                    f"({self.bf16_quantized_max_rows}) at least max_num_batched_tokens "
                    f"({max_num_batched_tokens}): every product of a step on the block kernel."
                )
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=settings.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            dtype=cache_dtype,
            prefault_when_idle=self.kv_cache_prefault,
        )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=self.scheduling_policy,
            target_step_ms=self.target_step_ms,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            prefill_order=self.prefill_order,
            oldest_prompt_share=self.oldest_prompt_share,
            admission_lookahead_tokens=self.admission_lookahead_tokens,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
            encoder_cache_size=self.encoder_cache_size,
        )
        return EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            parallel_config,
            kernel_config,
            lora_config=self._lora_config(),
            speculative_config=speculative_config,
            kv_transfer_config=kv_transfer_config_for(
                self.kv_transfer_config, model_config, cache_config, self.kv_offloading_size
            ),
        )

    def _multimodal_config(self, architecture: str) -> MultiModalConfig | None:
        if architecture not in MULTIMODAL_ARCHITECTURES:
            return None  # a text-only model: any image is refused (engine/processor.py)
        return MultiModalConfig(parse_limit_mm_per_prompt(self.limit_mm_per_prompt))

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        max_cpu_loras = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        return LoRAConfig(self.max_loras, self.max_lora_rank, max_cpu_loras)

    def _validate_numbers(self) -> None:
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size",
                     "max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}.")
        if self.admission_lookahead_tokens < 0:
            raise ValueError(
                "admission_lookahead_tokens must be non-negative, got "
                f"{self.admission_lookahead_tokens}."
            )
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}.")
        target = self.target_step_ms
        if target is not None and (
            isinstance(target, bool)
            or not isinstance(target, (int, float))
            or not 0 < target < math.inf
        ):
            raise ValueError(
                f"target_step_ms must be a positive number of milliseconds, got {target!r}."
            )
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be a non-negative number of tokens, got "
                f"{threshold!r}."
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}."
            )
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(
                f"prefill_order must be 'shortest' or 'arrival', got {self.prefill_order!r}."
            )
        share = self.oldest_prompt_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"oldest_prompt_share must be between 0 and 1, got {share!r}.")

    def _resolve_kv_cache_dtype(self, model_dtype: str) -> str:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}."
            )
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    def _resolve_max_model_len(self, hf_config) -> int:
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        sliding_window = getattr(hf_config, "sliding_window", None)
        if sliding_window and getattr(hf_config, "use_sliding_window", True):
            # Full attention equals sliding-window attention only within the window.
            limit = min(limit, sliding_window)
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds what the model supports ({limit})."
            )
        return self.max_model_len

    def _resolve_num_blocks(
        self,
        model_config: ModelConfig,
        cache_dtype: str,
        speculative_config: SpeculativeConfig | None = None,
        parallel_config: ParallelConfig | None = None,
    ) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        memory = DEFAULT_CPU_KV_CACHE_MEMORY
        if self.kv_cache_memory is not None:
            memory = parse_memory(self.kv_cache_memory)
        # kv_cache_memory is each rank's: it holds its stage's layers and its KV heads.
        bytes_per_token = model_config.kv_bytes_per_token(cache_dtype, parallel_config)
        if speculative_config is not None and speculative_config.draft_model_config is not None:
            # A draft model's cache has the same blocks: the memory holds both.
            bytes_per_token += speculative_config.draft_model_config.kv_bytes_per_token(cache_dtype)
        bytes_per_block = bytes_per_token * self.block_size
        num_blocks = memory // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={memory} bytes is smaller than one KV block ({bytes_per_block} bytes)."
            )
        # More blocks than every running sequence at full length could hold only serve
        # as extra prefix cache; cap them so a tiny model does not zero gigabytes.
        useful = -(-self.max_num_seqs * model_config.max_model_len // self.block_size)
        return int(min(num_blocks, useful))
