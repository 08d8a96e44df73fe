"""The llama family (Llama, Mistral, Qwen2) over a paged KV cache.

One flat batch per step: `input_ids` and `positions` are [num_tokens], with no
per-request padding; attention finds each request's context through the metadata.
Q/K/V and gate/up projections are fused at load time (one matmul each instead of
three and two). On CPU, `pack_weights()` then moves every projection (and the logits
matrix) to oneDNN's prepacked layout (model/linear.py); for a GGUF model,
`load_quantized_weights()` first keeps their Q4_1 / Q8_0 blocks too, which decode's
few-row products read instead (model/quantized.py), and a decode-only step of few rows then
runs each layer as one C call (model/fused_decode.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenserve.attention.backend import AttentionBackend, AttentionMetadata
from tokenserve.kernels import layer_ops
from tokenserve.model.fused_decode import FusedDecode
from tokenserve.model.linear import linear, pack_weight
from tokenserve.model.quantized import QuantizedWeight, gemm_max_rows, max_rows, usable_for
from tokenserve.model.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = layer_ops() if dtype == torch.float32 else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise x; with `residual`, first add x into it in place (the residual stream)
        and normalise the sum."""
        if self.ops is not None and x.device.type == "cpu":
            return self.ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        # Normalise in fp32 whatever the dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _silu_and_mul(gate_up: torch.Tensor, ops) -> torch.Tensor:
    if ops is not None and gate_up.device.type == "cpu":
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, dtype: torch.dtype, qkv_bias: bool) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        intermediate = hf_config.intermediate_size
        self.intermediate_size = intermediate

        self.input_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps, dtype)
        self.qkv_weight = _empty_parameter(self.q_size + 2 * self.kv_size, hidden, dtype=dtype)
        self.qkv_bias = (
            _empty_parameter(self.q_size + 2 * self.kv_size, dtype=dtype) if qkv_bias else None
        )
        self.o_weight = _empty_parameter(hidden, self.q_size, dtype=dtype)
        self.gate_up_weight = _empty_parameter(2 * intermediate, hidden, dtype=dtype)
        self.down_weight = _empty_parameter(hidden, intermediate, dtype=dtype)
        self.mlp_ops = layer_ops() if dtype == torch.float32 else None
        # Parameter name → its oneDNN-packed form, once pack_weights() has run.
        self.packed: dict[str, torch.Tensor] = {}
        # Parameter name → its GGUF block-quantized copy (load_quantized_weights).
        self.quantized: dict[str, QuantizedWeight] = {}

    def pack_weights(self) -> None:
        for name in _PROJECTIONS:
            if name in self.packed:
                continue  # packed already: the dense weight is gone
            packed = pack_weight(getattr(self, name))
            if packed is not None:
                self.packed[name] = packed
                # The packed copy is the weight from now on; free the dense one.
                getattr(self, name).data = torch.empty(0, dtype=self.packed[name].dtype)

    def _project(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None):
        return linear(x, getattr(self, name), bias, self.packed.get(name), self.quantized.get(name))

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryEmbedding,
        attention: AttentionBackend,
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
        qkv = self._project(x, "qkv_weight", self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = x.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        attn = attention.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        attn_out = self._project(attn.reshape(num_tokens, self.q_size), "o_weight")

        x = self.post_attention_layernorm(attn_out, residual)
        gate_up = self._project(x, "gate_up_weight")
        return self._project(_silu_and_mul(gate_up, self.mlp_ops), "down_weight"), residual


_PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

# HF checkpoint names of one layer's tensors → (our parameter, slot in the fused tensor).
_FUSED_PARTS = {
    "self_attn.q_proj.weight": ("qkv_weight", 0),
    "self_attn.k_proj.weight": ("qkv_weight", 1),
    "self_attn.v_proj.weight": ("qkv_weight", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "mlp.gate_proj.weight": ("gate_up_weight", 0),
    "mlp.up_proj.weight": ("gate_up_weight", 1),
}
_PLAIN_PARTS = {
    "self_attn.o_proj.weight": "o_weight",
    "mlp.down_proj.weight": "down_weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Tensors some checkpoints carry that inference does not use.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral and Qwen2 differ here only in qkv bias (Qwen2) and tied embeddings."""

    def __init__(
        self, hf_config, dtype: torch.dtype, attention: AttentionBackend, max_position: int
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.attention = attention
        qkv_bias = getattr(hf_config, "attention_bias", False) or hf_config.model_type == "qwen2"
        self.embed_tokens = _empty_parameter(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, dtype, qkv_bias) for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else _empty_parameter(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype)
        )
        head_dim = self.layers[0].head_dim
        self.rotary = RotaryEmbedding(hf_config, head_dim, max_position, dtype)
        self.packed_logits: torch.Tensor | None = None
        self.quantized_logits: QuantizedWeight | None = None
        self._fused_decode: FusedDecode | None = None

    def pack_weights(self) -> None:
        """Prepack the projections and the logits matrix for oneDNN (CPU only; a no-op
        elsewhere). Call once, after load_weights()."""
        for layer in self.layers:
            layer.pack_weights()
        if self.packed_logits is not None:
            return
        # The embedding table stays dense even when tied: the lookup needs it.
        self.packed_logits = pack_weight(self.embed_tokens if self.lm_head is None else self.lm_head)
        if self.packed_logits is not None and self.lm_head is not None:
            self.lm_head.data = torch.empty(0, dtype=self.packed_logits.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = F.embedding(input_ids, self.embed_tokens)
        if self._fused_decode is None:
            self._fused_decode = FusedDecode(self)  # the weights are final by the first step
        if self._fused_decode.takes(hidden_states.shape[0], metadata):
            hidden_states, residual = self._fused_decode.forward(
                hidden_states, positions, kv_caches, metadata
            )
            return self.norm(hidden_states, residual)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, self.rotary, self.attention,
                metadata,
            )
        return self.norm(hidden_states, residual)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(
            hidden_states, weight, packed=self.packed_logits, quantized=self.quantized_logits
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if _IGNORED.search(name):
                continue
            target, offset = self._locate(name)
            if target == "<tied>":
                continue  # Some tied checkpoints still carry a copy of the embeddings.
            if target is None or target not in params:
                raise ValueError(f"Unexpected tensor {name!r} in the checkpoint.")
            param = params[target]
            rows = tensor.shape[0]
            destination = param.data if offset is None else param.data[offset : offset + rows]
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"Tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(destination.shape)} from the model config."
                )
            destination.copy_(tensor.to(self.dtype))
            loaded.add(name)
        expected = self._expected_names()
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"The checkpoint is missing {len(missing)} tensor(s): {shown}")

    def load_quantized_weights(self, weights: Iterable[tuple[str, QuantizedWeight]]) -> int:
        """Keep block-quantized copies (model/quantized.py) of the projections and the logits
        matrix beside their float32 weights, for few-row products. Call after load_weights()
        and before pack_weights(). A fused weight gets a copy only when every part has one of
        the same kind. Returns how many weights got one."""
        parts: dict[str, dict[int, QuantizedWeight]] = {}
        for name, weight in weights:
            target, offset = self._locate(name)
            if target is not None:
                parts.setdefault(target, {})[offset or 0] = weight
        params = dict(self.named_parameters())
        logits_name = "embed_tokens" if self.lm_head is None else "lm_head"
        count = 0
        for target, pieces in parts.items():
            fused = QuantizedWeight.concat([pieces[offset] for offset in sorted(pieces)])
            if fused is None or target not in params or not usable_for(fused, params[target].shape):
                continue
            fused.max_rows, fused.gemm_max_rows = max_rows(), gemm_max_rows()
            if target == logits_name:
                self.quantized_logits = fused
            else:
                layer, _, attribute = target.removeprefix("layers.").partition(".")
                if attribute not in _PROJECTIONS:
                    continue
                self.layers[int(layer)].quantized[attribute] = fused
            count += 1
        return count

    def _locate(self, name: str) -> tuple[str | None, int | None]:
        if name == "model.embed_tokens.weight":
            return "embed_tokens", None
        if name == "model.norm.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            return ("lm_head", None) if self.lm_head is not None else ("<tied>", None)
        match = _LAYER_NAME.match(name)
        if match is None:
            return None, None
        index, suffix = int(match.group(1)), match.group(2)
        prefix = f"layers.{index}."
        if suffix in _PLAIN_PARTS:
            return prefix + _PLAIN_PARTS[suffix], None
        if suffix in _FUSED_PARTS:
            target, part = _FUSED_PARTS[suffix]
            layer = self.layers[index] if index < len(self.layers) else None
            if layer is None:
                return None, None
            if target == "gate_up_weight":
                return prefix + target, part * layer.intermediate_size
            return prefix + target, (0, layer.q_size, layer.q_size + layer.kv_size)[part]
        return None, None

    def _expected_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            suffixes = list(_PLAIN_PARTS) + [
                s for s in _FUSED_PARTS if layer.qkv_bias is not None or not s.endswith("bias")
            ]
            names.update(f"model.layers.{i}.{s}" for s in suffixes)
        return names
