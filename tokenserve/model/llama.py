"""The llama family (Llama, Mistral, Qwen2) over a paged KV cache.

One flat batch per step: `input_ids` and `positions` are [num_tokens], with no per-request
padding; attention finds each request's context through the backend's metadata. Q/K/V and
gate/up are merged layers (one product each instead of three and two); `load_weights` routes
the checkpoint's separate tensors to their shards. How each product runs (oneDNN, GGUF
blocks) is the linear layers' quantization method; how a step's layers run (one by one, or
each as one C call for a few-row decode step) is the layer stack's.

Under tensor parallelism (`ModelParallel.tp`) every projection holds its rank's heads or
rows and the row-parallel ones sum over the ranks; under pipeline parallelism a rank builds
only its stage's layers (the others are empty placeholders, so parameter names keep the
checkpoint's layer numbers), receives the residual stream from the stage before and sends
it to the next; only the last stage has the final norm and the LM head.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from tokenserve.attention.backend import AttentionBackend, AttentionMetadata
from tokenserve.config import KernelConfig
from tokenserve.distributed.parallel_state import ModelParallel, TensorParallelGroup
from tokenserve.kernels.row_buckets import empty_rows
from tokenserve.model.fused_decode import FusedDecodeLayerStack
from tokenserve.model.layers.activation import SiluAndMul
from tokenserve.model.layers.attention import Attention
from tokenserve.model.layers.layernorm import RMSNorm
from tokenserve.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenserve.model.layers.quantization import QuantizationMethod
from tokenserve.model.layers.rotary_embedding import RotaryEmbedding
from tokenserve.model.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenserve.model.layers.weight_loading import default_weight_loader


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend,
        linear_method: QuantizationMethod,
        dtype: torch.dtype,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup()
        hidden_size = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        head_dim = _head_dim(config)
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, total_num_heads, total_num_kv_heads, bias=qkv_bias,
            quant_method=linear_method, params_dtype=dtype, tp_size=tp.size, tp_rank=tp.rank,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            total_num_heads * head_dim, hidden_size, quant_method=linear_method, params_dtype=dtype,
            tp_size=tp.size, tp_rank=tp.rank, tp_group=tp,
        )
        self.dtype = dtype
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, backend)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.rotary_emb.forward_qkv(
            positions, self.qkv_proj(hidden_states), self.num_heads, self.num_kv_heads
        )
        return self.project_output(self.attn(q, k, v, kv_cache, metadata))

    def project_output(self, attn_output: torch.Tensor) -> torch.Tensor:
        """o_proj over the attention's output [T, heads, D]. A bf16 product reads it rounded
        to bf16 here, so its sums stay bf16 for the norm after (one cast, not two)."""
        attn_output = attn_output.reshape(attn_output.shape[0], self.q_size)
        input_dtype = product_input_dtype(self.o_proj, attn_output.shape[0])
        if input_dtype is not None and input_dtype != attn_output.dtype:
            # With room for the product's padded rows (kernels/row_buckets.py).
            attn_output = empty_rows(
                tuple(attn_output.shape), input_dtype, attn_output.device
            ).copy_(attn_output)
        return self.o_proj(attn_output)

    def project_qkv(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v in the activations' dtype, not rotated (a bf16 product hands its
        sums in bf16)."""
        qkv = self.qkv_proj(hidden_states)
        return qkv if qkv.dtype == self.dtype else qkv.to(self.dtype)


def product_input_dtype(linear: nn.Module, rows: int) -> torch.dtype | None:
    """What a linear layer's product of `rows` rows reads, where it is not the activations'
    dtype (a bf16 model's products: the operator before hands its result in bf16); None
    otherwise, also for a wrapper that adds to the product (a LoRA layer)."""
    input_dtype = getattr(linear, "input_dtype", None)
    return None if input_dtype is None else input_dtype(rows)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config,
        linear_method: QuantizationMethod,
        dtype: torch.dtype,
        use_c_kernels: bool,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup()
        hidden_size, intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, quant_method=linear_method, params_dtype=dtype,
            tp_size=tp.size, tp_rank=tp.rank,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, quant_method=linear_method, params_dtype=dtype,
            tp_size=tp.size, tp_rank=tp.rank, tp_group=tp,
        )
        self.act_fn = SiluAndMul(dtype, use_c_kernels)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = product_input_dtype(self.down_proj, x.shape[0]) or self.dtype
        return self.down_proj(self.act_fn(self.gate_up_proj(x), out_dtype))


class LlamaDecoderLayer(nn.Module):
    # The attention a model of the family uses (Qwen3 adds q/k norms: model/qwen3.py).
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(
        self,
        config,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend,
        linear_method: QuantizationMethod,
        dtype: torch.dtype,
        use_c_kernels: bool,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, use_c_kernels)
        self.self_attn = self.attention_class(config, rotary_emb, backend, linear_method, dtype, tp)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, use_c_kernels
        )
        self.mlp = LlamaMLP(config, linear_method, dtype, use_c_kernels, tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream: returns (this layer's MLP output, the stream
        before it is added). `residual` is None for the first layer, whose input is the
        stream itself; the next norm adds the two (fused with the norm on CPU)."""
        # Each norm hands its result in the dtype its product reads (bf16 for bf16 products).
        rows = hidden_states.shape[0]
        qkv_dtype = product_input_dtype(self.self_attn.qkv_proj, rows)
        if residual is None:
            residual = hidden_states
            x = self.input_layernorm(hidden_states, out_dtype=qkv_dtype)
        else:
            x = self.input_layernorm(hidden_states, residual, qkv_dtype)
        attn_output = self.self_attn(positions, x, kv_cache, metadata)
        x = self.post_attention_layernorm(
            attn_output, residual, product_input_dtype(self.mlp.gate_up_proj, rows)
        )
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    decoder_layer_class: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        backend: AttentionBackend,
        max_position: int,
        linear_method: QuantizationMethod,
        kernel_config: KernelConfig,
        parallel: ModelParallel | None = None,
    ) -> None:
        super().__init__()
        parallel = parallel or ModelParallel()
        tp, self.pp = parallel.tp, parallel.pp
        self.hidden_size, self.dtype = config.hidden_size, dtype
        if tp.size > 1:
            # The fused C decode layer has no all-reduce between its products.
            kernel_config = dataclasses.replace(kernel_config, disable_fused_decode=True)
        use_c_kernels = not kernel_config.disable_c_kernels
        self.embed_tokens = (
            VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, params_dtype=dtype,
                tp_size=tp.size, tp_rank=tp.rank, tp_group=tp,
            )
            if self.pp.is_first
            else None
        )
        # One table of cos/sin for all layers.
        rotary_emb = RotaryEmbedding(config, _head_dim(config), max_position, dtype, use_c_kernels)
        self.layer_range = self.pp.layers(config.num_hidden_layers)
        self.layers = nn.ModuleList(
            self.decoder_layer_class(
                config, rotary_emb, backend, linear_method, dtype, use_c_kernels, tp
            )
            if index in self.layer_range
            else nn.Identity()  # another stage's layer
            for index in range(config.num_hidden_layers)
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, use_c_kernels)
            if self.pp.is_last
            else None
        )
        # The layers over a step: one by one, or a few-row decode step as one C call per layer.
        local_layers = nn.ModuleList(self.layers[index] for index in self.layer_range)
        self.layer_stack = FusedDecodeLayerStack(local_layers, kernel_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The final hidden states; None on a pipeline stage before the last (which sends
        its residual stream on instead). `inputs_embeds`: the step's input embeddings when
        some are not the tokens' own (a vision-language model's image rows); None: embed
        `input_ids`."""
        if self.pp.is_first:
            hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            shape = (positions.shape[0], self.hidden_size)
            hidden_states, residual = self.pp.recv(shape, self.dtype, 2)
        hidden_states, residual = self.layer_stack(
            positions, hidden_states, kv_caches, metadata, residual
        )
        if not self.pp.is_last:
            # The last MLP's sums may be a bf16 product's: sent in the activations' dtype.
            self.pp.send([hidden_states.to(self.dtype), residual])
            return None
        return self.norm(hidden_states, residual)


# Tensors some checkpoints carry that inference does not use.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral and Qwen2 differ here only in qkv bias (Qwen2) and tied embeddings."""

    # Checkpoint projections → (the merged layer that holds them, their shard in it).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    model_class: ClassVar[type[LlamaModel]] = LlamaModel

    def __init__(
        self,
        hf_config,
        dtype: torch.dtype,
        attention: AttentionBackend,
        max_position: int,
        linear_method: QuantizationMethod,
        kernel_config: KernelConfig,
        parallel: ModelParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.linear_method = linear_method
        parallel = parallel or ModelParallel()
        self.model = self.model_class(
            hf_config, dtype, attention, max_position, linear_method, kernel_config, parallel
        )
        tp = parallel.tp
        self.lm_head = (
            ParallelLMHead(
                hf_config.vocab_size, hf_config.hidden_size, quant_method=linear_method,
                params_dtype=dtype, tp_size=tp.size, tp_rank=tp.rank, tp_group=tp,
            )
            if parallel.pp.is_last
            else None
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and self.lm_head and self.model.embed_tokens:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits, in the dtype of the head's product: bfloat16 from a bf16 product
        (the sampler reads them once, as they are; who computes with them takes float32)."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        input_dtype = self.lm_head.quant_method.input_dtype(self.lm_head, hidden_states.shape[0])
        if input_dtype is not None:
            hidden_states = hidden_states.to(input_dtype)
        return self.lm_head(hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Hand each checkpoint tensor (HF names) to its parameter's weight loader, the
        separate q/k/v and gate/up projections as shards of their merged layers. A weight
        may come twice, dense and in another form (GGUF blocks) for the methods that keep it."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, loaded_weight in weights:
            if _IGNORED.search(name) or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue  # Some tied checkpoints still carry a copy of the embeddings.
            if not self._held_here(name):
                continue  # another pipeline stage's
            param_name, shard_id = self._param_for(name)
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"Unexpected tensor {name!r} in the checkpoint.")
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, loaded_weight, shard_id)
            except ValueError as error:
                raise ValueError(f"Tensor {name!r}: {error}.") from None
            loaded.update((name, param_name))  # a tied head on a later stage: lm_head
        missing = sorted(self._checkpoint_names(params) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"The checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _held_here(self, name: str) -> bool:
        """Whether this pipeline stage holds the checkpoint tensor `name`."""
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer is not None:
            return int(layer.group(1)) in self.model.layer_range
        if name.startswith("model.embed_tokens."):
            # A tied LM head on a later stage loads the embedding table as its weight.
            return self.model.embed_tokens is not None or (
                self.tie_word_embeddings and self.model.pp.is_last
            )
        if name.startswith(("model.norm.", "lm_head.")):
            return self.model.pp.is_last
        return True

    def _param_for(self, name: str) -> tuple[str, str | int | None]:
        if name.startswith("model.embed_tokens.") and self.model.embed_tokens is None:
            return name.replace("model.embed_tokens.", "lm_head."), None
        for checkpoint_part, (merged, shard_id) in self.packed_modules_mapping.items():
            if f".{checkpoint_part}." in name:
                return name.replace(f".{checkpoint_part}.", f".{merged}."), shard_id
        return name, None

    def _checkpoint_names(self, params: dict[str, nn.Parameter]) -> set[str]:
        """The checkpoint tensors the parameters need (a merged one needs each of its parts)."""
        parts_of: dict[str, list[str]] = {}
        for part, (merged, _) in self.packed_modules_mapping.items():
            parts_of.setdefault(merged, []).append(part)
        names = set()
        for name in params:
            merged = next((merged for merged in parts_of if f".{merged}." in name), None)
            if merged is None:
                names.add(name)
            else:
                names.update(name.replace(f".{merged}.", f".{part}.") for part in parts_of[merged])
        return names
