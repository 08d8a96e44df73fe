"""Resolved engine configuration: the model, the KV cache, the scheduler, the executor,
the CPU kernels and LoRA.

`EngineArgs` (engine/engine_args.py) turns user-facing arguments into these; every
value here is validated and final.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The runners a model can run under (vLLM's --runner): sampling tokens, or pooling a prompt.
RUNNERS = ("auto", "generate", "pooling")
# Pooling types (vLLM's names): the last token's hidden state, the mean over the prompt, the
# first token's (CLS).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one vector: from a
    sentence-transformers directory (1_Pooling, 2_Normalize), else the architecture's
    default (model/pooler_config.py)."""

    pooling_type: str = "LAST"
    normalize: bool = True


# The dtypes a model or KV cache may have, by name, and their bytes per element: configurations
# hold names, so that the API process, which builds one too, imports no torch.
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` (a key of DTYPE_SIZES); imports torch (engine side)."""
    import torch

    return getattr(torch, name)


# Items of a modality a prompt may hold unless --limit-mm-per-prompt says (vLLM V1's default).
DEFAULT_MM_LIMIT_PER_PROMPT = 999


@dataclass
class MultiModalConfig:
    """A multimodal model's inputs (multimodal/): the most items of each modality one prompt
    may hold (vLLM's `limit_mm_per_prompt`, {"image": N})."""

    limit_per_prompt: dict[str, int] = field(default_factory=dict)

    def get_limit_per_prompt(self, modality: str) -> int:
        return self.limit_per_prompt.get(modality, DEFAULT_MM_LIMIT_PER_PROMPT)


@dataclass
class ModelConfig:
    model: str
    format: str  # "hf" or "gguf"
    architecture: str
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # a name of DTYPE_SIZES; `torch_dtype` is the torch dtype
    max_model_len: int
    files: Any  # model.loader.LoadedModelFiles: where the weights and tokenizer come from
    tokenizer: str | None = None
    seed: int = 0
    max_logprobs: int = 20
    # Prefill chunks sharing a long cached prefix attend to it in one call
    # (attention/torch_sdpa.py); True turns that off.
    disable_cascade_attn: bool = False
    # "generate" or "pooling" (resolved from "auto" by the architecture).
    runner: str = "generate"
    # Pooling runner only: the tasks the model serves and how it pools.
    pooling_tasks: tuple[str, ...] = ()
    pooler_config: PoolerConfig | None = None
    # Encoder-only (BERT): bidirectional attention, no KV cache, no chunked prefill.
    is_encoder_only: bool = False
    # Matryoshka embeddings: `dimensions` may shorten them.
    is_matryoshka: bool = False
    # A vision-language model (LLaVA, Idefics3): its inputs' limits; None: text only.
    multimodal_config: MultiModalConfig | None = None

    @property
    def text_config(self) -> Any:
        """The language model's config: a vision-language model's `text_config`, else the config."""
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        config = self.text_config
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.text_config, "head_dim", None)
        return head_dim or self.text_config.hidden_size // self.text_config.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    def kv_bytes_per_token(
        self, cache_dtype: str | None = None, parallel: ParallelConfig | None = None
    ) -> int:
        """Bytes of K and V per token over all layers, in `cache_dtype` (a name; default:
        the model's dtype); with `parallel`, over one rank's layers and KV heads."""
        element_size = DTYPE_SIZES[cache_dtype or self.dtype]
        layers, kv_heads = self.num_layers, self.num_kv_heads
        if parallel is not None:
            layers = len(parallel.stage_layers(layers, 0))
            kv_heads = parallel.kv_heads_per_rank(kv_heads)
        return 2 * layers * kv_heads * self.head_dim * element_size


@dataclass
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    # What the KV cache stores, by name: the model's dtype, bfloat16 or an 8-bit float
    # (float8_e4m3fn, float8_e5m2) (--kv-cache-dtype).
    dtype: str = "float32"
    # A CPU cache's pages faulted in while the engine core is idle, ahead of their first
    # use (--kv-cache-prefault; worker/cpu_memory.py); else each on first use only.
    prefault_when_idle: bool = True

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size


# How many tokens of each request's growth admission looks ahead at (core/kv_lookahead.py).
DEFAULT_LOOKAHEAD_TOKENS = 256
# The orders in which a step's prompt chunks are granted (SchedulerConfig.prefill_order).
PREFILL_ORDERS = ("shortest", "arrival")
# The share of a step's prompt tokens held for the oldest prompt under "shortest".
DEFAULT_OLDEST_PROMPT_SHARE = 0.5


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool
    policy: str
    # Milliseconds: each step's prompt tokens are sized so the step's predicted time stays
    # within it (decodes always run); None: max_num_batched_tokens alone limits a step.
    target_step_ms: float | None = None
    # Tokens: the most of one prompt a step computes while other requests run or wait
    # (vLLM's long_prefill_token_threshold), so a long prompt is spread over steps beside the
    # running decodes; 0: no such limit. Needs chunked prefill.
    long_prefill_token_threshold: int = 0
    # After the decode rows, prompt chunks go to the fewest remaining prompt tokens first
    # ("shortest"), or to running prompts and then the waiting queue ("arrival"). The
    # priority policy always takes "arrival" (in priority order).
    prefill_order: str = "shortest"
    # Under "shortest": the share of each step's prompt tokens (what its decode rows leave)
    # held for the running prompt that arrived first, so short prompts arriving one after
    # another cannot hold a long one back indefinitely; 0: none held.
    oldest_prompt_share: float = DEFAULT_OLDEST_PROMPT_SHARE
    # Admit a request only if the running requests and it fit the KV pool over their next
    # this many tokens of growth (core/kv_lookahead.py); 0: admit whenever the prompt fits.
    admission_lookahead_tokens: int = DEFAULT_LOOKAHEAD_TOKENS
    # Multimodal models: image encoder output tokens one step may compute (vLLM's name), and
    # how many the encoder cache holds; None: max_num_batched_tokens, as vLLM.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_encoder_input_tokens is None:
            self.max_num_encoder_input_tokens = self.max_num_batched_tokens
        if self.encoder_cache_size is None:
            self.encoder_cache_size = self.max_num_encoder_input_tokens


# The executors the engine core can run the model with (executor/backends.py): "uni", one
# worker in the engine core's process; "mp", one worker process per rank on this machine;
# "ray", one Ray actor per rank, on the machines of a Ray cluster.
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How the model is split over ranks (docs/PARALLELISM.md): tensor parallel within a
    pipeline stage, pipeline stages over the layers; rank = pp_rank * tp_size + tp_rank.
    `distributed_executor_backend` None: "uni" for one rank, else "mp". Data parallelism
    runs `data_parallel_size` engine cores, each with its own ranks and KV cache, behind one
    API server (engine/dp_client.py)."""

    distributed_executor_backend: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                "distributed_executor_backend must be one of "
                f"{list(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}."
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size} needs 'mp' or 'ray'."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(
        self, num_heads: int, num_kv_heads: int, num_layers: int, vocab_size: int
    ) -> None:
        """ValueError when the model's heads, vocabulary or layers do not split over the ranks."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if num_heads % tp:
            raise ValueError(
                f"The model's {num_heads} attention heads do not split over "
                f"tensor_parallel_size={tp} ranks; pick a size that divides {num_heads}."
            )
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"The model's {num_kv_heads} KV heads neither split over nor replicate evenly "
                f"on tensor_parallel_size={tp} ranks."
            )
        if vocab_size % tp:
            raise ValueError(
                f"The model's vocabulary of {vocab_size} tokens does not split over "
                f"tensor_parallel_size={tp} ranks."
            )
        if num_layers % pp:
            raise ValueError(
                f"The model's {num_layers} layers do not split over pipeline_parallel_size={pp} "
                f"stages; pick a size that divides {num_layers}."
            )

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """A tensor-parallel rank's KV heads: its share, or one (replicated) when the model
        has fewer KV heads than ranks."""
        return max(1, num_kv_heads // self.tensor_parallel_size)

    def stage_layers(self, num_layers: int, pp_rank: int) -> range:
        return stage_layers(num_layers, self.pipeline_parallel_size, pp_rank)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers pipeline stage `pp_rank` of `pp_size` holds (equal consecutive
    shares; ParallelConfig.check_model refuses a split that is not even)."""
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


# The most rows of a product that go to a GGUF weight's few-row kernel and its many-row
# (panel) kernel: where they cross each other and oneDNN's float32 GEMM for SmolLM2-135M's
# shapes (benchmarks/quantized_linear.py).
DEFAULT_QUANTIZED_MAX_ROWS = 10
DEFAULT_QUANTIZED_GEMM_MAX_ROWS = 192
# bfloat16 models: the most rows of a product that still reads the GGUF blocks, oneDNN's bf16
# GEMM above (docs/PERFORMANCE_CPU.md). By the blocks' kernel (KernelConfig.
# bf16_block_max_rows): on amx the AMX kernel (bf16 numerics) makes the default model's steps
# faster than oneDNN's bf16 GEMM up to 1024 rows (a fused prompt step 10-27 % faster at
# 640-1024 rows), slower from ~1,536; on avx512_bf16 the vdpbf16ps kernel (the same
# numerics; its panel form above 8 rows) makes decode steps faster up to max_num_seqs'
# default, 128 (a fused step of the default model against oneDNN above 16 rows: 1.16-1.88x
# faster at 17-128 rows); below those levels the float32 block kernels lead it only in the
# smallest decode steps.
DEFAULT_BF16_QUANTIZED_MAX_ROWS = 1024
BF16_QUANTIZED_MAX_ROWS_DP = 128
BF16_QUANTIZED_MAX_ROWS_WITHOUT_AMX = 16
# bfloat16 GGUF models: products of at most this many rows multiply the blocks by x rounded
# to 8 bits per block (kernels/csrc/quant_i8.h: VNNI on the avx512_bf16 and amx levels,
# vpmaddubsw below), as llama.cpp and vLLM's GGUF kernels do; faster than the AMX kernel up
# to ~6 rows, and than the float32 few-row kernel on AVX2 (docs/PERFORMANCE_CPU.md,
# "Few-row products with x rounded to 8 bits").
DEFAULT_INT8_ACTIVATION_MAX_ROWS = 4
# --cpu-isa: the instruction-set levels the C kernels build for (kernels/cpu_isa.py).
CPU_ISAS = ("auto", "avx2", "avx512", "avx512_bf16", "amx", "native")


@dataclass
class KernelConfig:
    """Which CPU fast paths the model's layers and the attention backend take (all on by
    default); switching one off is for comparison, or for a machine without a C compiler."""

    # The C kernels (kernels/): attention's paged decode and K/V writes, RMSNorm, SwiGLU,
    # rotary, GGUF block products, the fused decode layer. Off: pure-torch code everywhere.
    disable_c_kernels: bool = False
    # oneDNN's prepacked float32 GEMM for the linear layers on CPU. Off: F.linear (MKL).
    disable_onednn: bool = False
    # A step of few rows (decode rows, and prompt chunks the prompt-attention kernel takes)
    # runs each decoder layer as one C call (model/fused_decode.py). Off: operator by
    # operator (the same results).
    disable_fused_decode: bool = False
    # Products of at most this many rows take a GGUF weight's blocks through the few-row
    # kernel, and above it up to quantized_gemm_max_rows through the many-row kernel; oneDNN
    # above both. 0 turns a kernel off, both 0 the GGUF block path.
    quantized_max_rows: int = DEFAULT_QUANTIZED_MAX_ROWS
    quantized_gemm_max_rows: int = DEFAULT_QUANTIZED_GEMM_MAX_ROWS
    # A bfloat16 model's products of more rows than this go to oneDNN's bf16 GEMM whatever
    # the two limits above say (block_row_limits); None: by level (bf16_block_max_rows).
    bf16_quantized_max_rows: int | None = None
    # A request's greedy tokens independent of the batch it runs in (docs/PERFORMANCE_CPU.md,
    # "Outputs independent of the batch"): a GGUF model in bfloat16 on the amx level with
    # every product on the AMX block kernel, one row included, bf16_quantized_max_rows at
    # least the step budget (EngineArgs sets it). Refused elsewhere.
    batch_invariant: bool = False
    # A GGUF model's products of at most this many rows multiply its blocks by x rounded to
    # 8 bits per 32-value block (every x86-64 level); None: by dtype (int8_activation_rows),
    # 0: never.
    int8_activation_max_rows: int | None = None
    # The instruction set the C kernels are built for (kernels/cpu_isa.py): "auto", the
    # best the CPU has, or a lower level forced; --dtype auto takes bfloat16 only where the
    # level computes it natively (avx512_bf16, amx).
    cpu_isa: str = "auto"
    # A CPU worker moves the model's weights onto transparent huge pages while the engine
    # core is idle (worker/cpu_memory.py, WeightHugePages). Off: they stay where they were
    # loaded, on 4 KiB pages.
    weight_huge_pages: bool = True

    def __post_init__(self) -> None:
        if self.cpu_isa not in CPU_ISAS:
            raise ValueError(f"cpu_isa must be one of {list(CPU_ISAS)}, got {self.cpu_isa!r}.")
        for name in ("quantized_max_rows", "quantized_gemm_max_rows",
                     "bf16_quantized_max_rows", "int8_activation_max_rows"):
            value = getattr(self, name)
            if value is None and name in ("bf16_quantized_max_rows", "int8_activation_max_rows"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")

    def bf16_block_max_rows(self, kernel: str) -> int:
        """The most rows of a bfloat16 model's product on the GGUF blocks' `kernel` ("amx",
        "dp": vdpbf16ps, "float32"): the setting, or by default DEFAULT_BF16_QUANTIZED_MAX_ROWS,
        BF16_QUANTIZED_MAX_ROWS_DP or BF16_QUANTIZED_MAX_ROWS_WITHOUT_AMX."""
        if self.bf16_quantized_max_rows is not None:
            return self.bf16_quantized_max_rows
        return {"amx": DEFAULT_BF16_QUANTIZED_MAX_ROWS, "dp": BF16_QUANTIZED_MAX_ROWS_DP,
                "float32": BF16_QUANTIZED_MAX_ROWS_WITHOUT_AMX}[kernel]

    def int8_activation_rows(self, bf16_products: bool) -> int:
        """The most rows of a GGUF model's product with x rounded to 8 bits: the setting, or
        by default DEFAULT_INT8_ACTIVATION_MAX_ROWS for a bfloat16 model (whose products
        round x already, to bf16) and none for a float32 one; for a bfloat16 model at most
        bf16_quantized_max_rows where that is set (above it every product is oneDNN's); none
        with batch_invariant, whose products all take the AMX kernel."""
        if self.batch_invariant:
            return 0
        rows = self.int8_activation_max_rows
        if rows is None:
            rows = DEFAULT_INT8_ACTIVATION_MAX_ROWS if bf16_products else 0
        if bf16_products and self.bf16_quantized_max_rows is not None:
            rows = min(rows, self.bf16_quantized_max_rows)
        return rows

    def block_row_limits(self, bf16_products: bool) -> tuple[int, int]:
        """The most rows of a product on the GGUF float32 few-row and many-row kernels, for a
        model whose dense products are float32 or (bf16_products) bfloat16 without AMX."""
        if not bf16_products:
            return self.quantized_max_rows, self.quantized_gemm_max_rows
        cap = self.bf16_block_max_rows("float32")
        return min(self.quantized_max_rows, cap), min(self.quantized_gemm_max_rows, cap)


# Speculative decoding's proposers (spec_decode/), by vLLM's `method` names.
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, resolved from `speculative_config` (spec_decode/config.py)."""

    method: str  # one of SPECULATIVE_METHODS
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix of a request's tokens looked up earlier in them.
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    # draft_model: the smaller model's resolved config (a ModelConfig; same vocabulary).
    draft_model_config: Any = None
    # No drafts in a step whose running requests outnumber this; None: always.
    disable_by_batch_size: int | None = None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its scheduled tokens: a draft model writes its own
        drafts' K/V there while it proposes (the same block table as the target's)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def speculates(self, num_running_reqs: int) -> bool:
        limit = self.disable_by_batch_size
        return limit is None or num_running_reqs <= limit


@dataclass
class LoRAConfig:
    """Multi-LoRA (`enable_lora`): how many adapters one step mixes (`max_loras`, each in a
    slot of the wrapped layers), the largest rank a slot holds, and how many adapters the
    workers keep loaded in memory (`max_cpu_loras`, least recently used dropped first)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras}): the adapters of one step are all loaded."
            )


# KV connector roles (vLLM's names): a producer saves or sends KV, a consumer loads or
# receives it, kv_both does both (kv_transfer/).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """A KV connector (`--kv-transfer-config`, vLLM's keys), resolved by
    kv_transfer/config.py: which connector, its role, where its listener binds, and the
    connector's own settings (`kv_connector_extra_config`)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # What the stored KV depends on beyond block hashes (model, layout, dtype): a store
    # shared by several models keeps each one's blocks apart.
    kv_layout_key: str = ""

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    # None: LoRA off (no layer is wrapped; a request with an adapter is refused).
    lora_config: LoRAConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    # None: no KV connector (only the in-process prefix cache).
    kv_transfer_config: KVTransferConfig | None = None
