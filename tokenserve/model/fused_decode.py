"""Decode steps of few rows, one C call per decoder layer (kernels/csrc/decode_layer.c).

A decode step of a few requests does little work per operator, so the ten calls of a layer
(two norms, four projections, rotary, the cache write, attention, SwiGLU), each checked in
Python and each forking and joining the OpenMP threads, cost about as much as the work: at 4
rows, a third of the step in the engine. When a step is decode only, has at most as many
rows as the quantized kernels take (192 by default), and every layer's projections have GGUF
blocks, the model runs each layer as one call instead. The C function calls the same operators in
the same order, so the results are identical (tests/model/test_fused_decode.py).

`TOKENSERVE_DISABLE_FUSED_DECODE=1` keeps every step on the operator-by-operator path.
"""

from __future__ import annotations

import os

import torch

from tokenserve import kernels
from tokenserve.attention.backend import AttentionMetadata

DISABLE_ENV = "TOKENSERVE_DISABLE_FUSED_DECODE"
_PARTS = (("qkv", "qkv_weight"), ("o", "o_weight"), ("gate_up", "gate_up_weight"),
          ("down", "down_weight"))


class FusedDecode:
    """The fused path for one model: which steps it takes, and running them."""

    def __init__(self, model) -> None:
        self.model = model
        self.ops = kernels.decode_layer()
        # The most rows every projection's quantized copy takes.
        self.max_rows = min(
            (weight.row_limit for layer in model.layers for _, name in _PARTS
             if (weight := layer.quantized.get(name)) is not None),
            default=0,
        )
        self.usable = (
            self.ops is not None
            and os.environ.get(DISABLE_ENV, "") in ("", "0")
            and model.dtype == torch.float32
            and model.rotary.ops is not None
            and all(name in layer.quantized for layer in model.layers for _, name in _PARTS)
        )
        # Layer index → (key cache address, bound layer, the tensors it points into).
        self._layers: dict[int, tuple] = {}

    def takes(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        """A decode-only step of at most max_rows rows, its attention on the C kernels."""
        if not self.usable or num_tokens > self.max_rows:
            return False
        # Every token a decode row: no prompt chunk (nor cascade) in the step.
        batch = metadata.backend_data.get("decode_batch")
        return batch is not None and batch.num_rows == num_tokens

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers on the step's embeddings: (last layer's output, residual)."""
        model = self.model
        first = model.layers[0]
        key_cache = kv_caches[0][0]
        step, _keep = self.ops.step(
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            hidden=hidden_states.shape[1],
            intermediate=first.intermediate_size,
            eps=first.input_layernorm.eps,
            scale=first.scale,
            positions=positions.contiguous(),
            slots=metadata.slot_mapping,
            decode_rows=metadata.backend_data["decode_batch"],
            cos=model.rotary.cos,
            sin=model.rotary.sin,
            block_size=key_cache.shape[2],
            kv_bf16=key_cache.dtype == torch.bfloat16,
        )
        residual = hidden_states
        out = torch.empty_like(hidden_states)
        spare = torch.empty_like(hidden_states)
        for index, (layer, (key_cache, value_cache)) in enumerate(zip(model.layers, kv_caches)):
            bound = self._layer(index, layer, key_cache, value_cache)
            self.ops.run(bound, step, hidden_states, residual, index > 0, out)
            # This layer's output is the next one's input; its input buffer takes the next
            # output (the first layer's input is the residual stream itself: not reused).
            hidden_states, out = out, (spare if index == 0 else hidden_states)
        return hidden_states, residual

    def _layer(self, index: int, layer, key_cache: torch.Tensor, value_cache: torch.Tensor):
        cached = self._layers.get(index)
        if cached is not None and cached[0] == key_cache.data_ptr():
            return cached[1]
        projections = {}
        for part, name in _PARTS:
            weight = layer.quantized[name]
            bias = layer.qkv_bias if part == "qkv" else None
            # Above max_rows, linear() takes the many-row kernel (when rows ≤ max_rows
            # passed above, the weight fits its panels).
            projections[part] = (weight.kind, weight.qs, weight.scales, bias, weight.max_rows)
        bound, keep = self.ops.layer(
            projections, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            key_cache, value_cache,
        )
        self._layers[index] = (key_cache.data_ptr(), bound, keep)
        return bound
