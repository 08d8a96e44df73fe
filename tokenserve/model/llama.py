"""The llama family (Llama, Mistral, Qwen2) over a paged KV cache.

One flat batch per step: `input_ids` and `positions` are [num_tokens], with no per-request
padding; attention finds each request's context through the backend's metadata. Q/K/V and
gate/up are merged layers (one product each instead of three and two); `load_weights` routes
the checkpoint's separate tensors to their shards. How each product runs (oneDNN, GGUF
blocks) is the linear layers' quantization method; how a step's layers run (one by one, or
each as one C call for a few-row decode step) is the layer stack's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from tokenserve.attention.backend import AttentionBackend, AttentionMetadata
from tokenserve.config import KernelConfig
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
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        head_dim = _head_dim(config)
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, total_num_heads, total_num_kv_heads, bias=qkv_bias,
            quant_method=linear_method, params_dtype=dtype,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            total_num_heads * head_dim, hidden_size, quant_method=linear_method, params_dtype=dtype
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, backend)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(attn_output.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self, config, linear_method: QuantizationMethod, dtype: torch.dtype, use_c_kernels: bool
    ) -> None:
        super().__init__()
        hidden_size, intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, quant_method=linear_method, params_dtype=dtype
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, quant_method=linear_method, params_dtype=dtype
        )
        self.act_fn = SiluAndMul(dtype, use_c_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


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
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, use_c_kernels)
        self.self_attn = self.attention_class(config, rotary_emb, backend, linear_method, dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, use_c_kernels
        )
        self.mlp = LlamaMLP(config, linear_method, dtype, use_c_kernels)

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
        if residual is None:
            residual = hidden_states
            x = self.input_layernorm(hidden_states)
        else:
            x = self.input_layernorm(hidden_states, residual)
        attn_output = self.self_attn(positions, x, kv_cache, metadata)
        x = self.post_attention_layernorm(attn_output, residual)
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
    ) -> None:
        super().__init__()
        use_c_kernels = not kernel_config.disable_c_kernels
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, params_dtype=dtype
        )
        # One table of cos/sin for all layers.
        rotary_emb = RotaryEmbedding(config, _head_dim(config), max_position, dtype, use_c_kernels)
        self.layers = nn.ModuleList(
            self.decoder_layer_class(
                config, rotary_emb, backend, linear_method, dtype, use_c_kernels
            )
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, use_c_kernels)
        # The layers over a step: one by one, or a few-row decode step as one C call per layer.
        self.layer_stack = FusedDecodeLayerStack(self.layers, kernel_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds`: the step's input embeddings when some are not the tokens' own
        (a vision-language model's image rows); None: embed `input_ids`."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden_states, residual = self.layer_stack(positions, hidden_states, kv_caches, metadata)
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
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.linear_method = linear_method
        self.model = self.model_class(
            hf_config, dtype, attention, max_position, linear_method, kernel_config
        )
        self.lm_head = ParallelLMHead(
            hf_config.vocab_size, hf_config.hidden_size, quant_method=linear_method,
            params_dtype=dtype,
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
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
            param_name, shard_id = self._param_for(name)
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"Unexpected tensor {name!r} in the checkpoint.")
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, loaded_weight, shard_id)
            except ValueError as error:
                raise ValueError(f"Tensor {name!r}: {error}.") from None
            loaded.add(name)
        missing = sorted(self._checkpoint_names(params) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"The checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _param_for(self, name: str) -> tuple[str, str | int | None]:
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
