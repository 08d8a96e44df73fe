"""Steps of few rows, all decoder layers in one C call (kernels/csrc/decode_layer.c).

A step of a few requests does little work per operator, so the ten calls of a layer (two
norms, four projections, rotary, the cache write, attention, SwiGLU), each checked in
Python and each forking and joining the OpenMP threads, cost about as much as the work
(docs/benchmarks/cpu-hot-path.md): ~10 ms a step of the default model, whatever its rows
(docs/PERFORMANCE_CPU.md, "Prompt chunks in the fused layer"). The layer stack runs a step
in one call instead (`ts_decode_layers`: each layer in one OpenMP region, its output handed
to the next in C; one call per layer cost ~5-8 us of Python and ctypes a layer, 2-3 % of a
one-row step and ~1 % of a 4-row one) when
- its attention runs on the CPU attention backend's C kernels: its decode rows on the paged
  decode kernel, its prompt chunks (if any) all on the prompt-attention kernel, as they are
  where they attend in bf16 or over a float32 cache (`TorchSDPABackend.prompt_kernel_takes`);
- it has at most as many rows as the GGUF block kernels take (192 by default; for a
  bfloat16 model `bf16_quantized_max_rows`: 1024 on amx, where its products take the AMX
  block kernel, 128 on avx512_bf16, through the vdpbf16ps block kernel, 16 elsewhere);
- and every layer's projections keep GGUF blocks.
decode_layer.c is the llama decoder layer (model/llama.py) written in C: it calls the same
operators in the same order, so the results are identical (tests/model/test_fused_decode.py).
It reads what the layers and the backend expose: the GGUF method's blocks, the norms'
weights, the rotary tables, the backend's typed decode batch and prompt chunk table, and its
cache layout. `--disable-fused-decode` keeps every step operator by operator.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenserve.attention.backend import AttentionMetadata
from tokenserve.attention.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from tokenserve.config import KernelConfig
from tokenserve.kernels import decode_layer, paged_attention
from tokenserve.model.layers.layer_stack import LayerStack
from tokenserve.model.layers.quantization.gguf import (
    DP_FEW_ROWS,
    GGUFLinearMethod,
    QuantizedWeight,
)


def _blocks(linear: nn.Module) -> QuantizedWeight | None:
    """A linear layer's GGUF blocks, where its quantization method keeps them."""
    return linear.blocks if isinstance(linear.quant_method, GGUFLinearMethod) else None


def _projections(layer: nn.Module) -> dict[str, nn.Module]:
    """A llama decoder layer's four linear layers, by decode_layer.c's names for them (a
    LoRA wrapper's base layer: steps with adapters never come here, lora/manager.py)."""
    linears = {
        "qkv": layer.self_attn.qkv_proj,
        "o": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
    }
    return {part: getattr(linear, "base_layer", linear) for part, linear in linears.items()}


class FusedDecodeLayerStack(LayerStack):
    """The llama layers over a step: a step of few rows the C layers take in one call,
    any other step one operator at a time (`LayerStack`)."""

    def __init__(self, layers: nn.ModuleList, kernel_config: KernelConfig) -> None:
        super().__init__(layers)
        wanted = not (kernel_config.disable_fused_decode or kernel_config.disable_c_kernels)
        self.ops = decode_layer.load() if wanted else None
        # Whether fused steps are taken (tests compare both ways on one model).
        self.enabled = self.ops is not None
        # The most rows every projection's blocks take; None until the first step, when
        # the weights are final.
        self._max_rows: int | None = None
        # Layer index → (key cache address, bound layer, the tensors it points into).
        self._bound: dict[int, tuple] = {}
        # The bound layers (held: the array points into them) and their pointer array.
        self._stacked: tuple[list, object] | None = None

    @property
    def max_rows(self) -> int:
        """The most rows of a step taken fused (0: none; the weights must be loaded)."""
        if self._max_rows is None:
            self._max_rows = self._row_limit()
        return self._max_rows

    def reset_row_limit(self) -> None:
        """Work max_rows out again at the next step (the blocks' row limits were changed:
        benchmarks/decode_step_cost.py)."""
        self._max_rows = None

    def _row_limit(self) -> int:
        rotary = self.layers[0].self_attn.rotary_emb
        blocks = [_blocks(linear) for layer in self.layers
                  for linear in _projections(layer).values()]
        if self.ops is None or rotary.ops is None or any(b is None for b in blocks):
            return 0
        return min(b.row_limit for b in blocks if b is not None)

    def takes(self, num_tokens: int, metadata: AttentionMetadata,
              kv_caches: list[torch.Tensor]) -> bool:
        """A step of at most max_rows rows whose attention runs on the C kernels: its decode
        rows on the paged decode kernel, its prompt chunks (if any) all on the
        prompt-attention kernel, as the backend would run them one layer at a time."""
        if not (self.enabled and num_tokens <= self.max_rows
                and isinstance(metadata, TorchSDPAMetadata)):
            return False
        if metadata.num_decode_rows and metadata.decode_batch is None:
            return False
        if metadata.is_decode_only:
            return True
        if metadata.prompt_batch is None:
            return False
        attn = self.layers[0].self_attn.attn
        key_cache, _ = TorchSDPABackend.split_kv_cache(kv_caches[0])
        return attn.backend.prompt_kernel_takes(attn.num_heads, key_cache)

    def __call__(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A later pipeline stage's input is mid-stream (its residual apart): operator by operator.
        if residual is not None or not self.takes(hidden_states.shape[0], metadata, kv_caches):
            return super().__call__(positions, hidden_states, kv_caches, metadata, residual)
        assert isinstance(metadata, TorchSDPAMetadata) and self.ops is not None
        first = self.layers[0]
        attn, rotary = first.self_attn.attn, first.self_attn.rotary_emb
        key_cache, _ = TorchSDPABackend.split_kv_cache(kv_caches[0])
        step, _keep = self.ops.step(
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_size,
            hidden=hidden_states.shape[1],
            intermediate=_projections(first)["down"].input_size_per_partition,
            eps=first.input_layernorm.eps,
            scale=attn.scale,
            positions=positions.contiguous(),
            slots=metadata.slot_mapping,
            decode_rows=metadata.decode_batch,
            prompt_chunks=metadata.prompt_batch,
            cos=rotary.cos,
            sin=rotary.sin,
            block_size=key_cache.shape[2],
            num_blocks=key_cache.shape[0],
            kv_mode=paged_attention.kv_mode(
                key_cache.dtype, attn.backend.bf16_decode(torch.float32, key_cache.dtype)),
            split_decode=attn.backend.split_decode,  # as the operators' decode kernel
        )
        residual = hidden_states
        # The layers in one C call; their outputs take turns between two buffers (the first
        # layer's input is the residual stream itself, never written).
        out = self.ops.run_layers(self._stack(kv_caches), step, hidden_states, residual,
                                  torch.empty_like(hidden_states),
                                  torch.empty_like(hidden_states))
        return out, residual

    def _stack(self, kv_caches: list[torch.Tensor]):
        """Every layer bound (`_bind`), as one array for the C call, rebuilt only when a
        layer is bound anew."""
        bound = [self._bind(index, layer, kv_cache)
                 for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches))]
        if self._stacked is None or any(
                old is not new for old, new in zip(self._stacked[0], bound, strict=True)):
            self._stacked = (bound, self.ops.stack(bound))
        return self._stacked[1]

    def _bind(self, index: int, layer: nn.Module, kv_cache: torch.Tensor):
        """The layer's weights and caches bound for the C call, once per cache."""
        cached = self._bound.get(index)
        if cached is not None and cached[0] == kv_cache.data_ptr():
            return cached[1]
        assert self.ops is not None
        projections = {}
        for part, linear in _projections(layer).items():
            blocks = _blocks(linear)
            assert blocks is not None
            # Above max_rows the many-row kernel, as the GGUF method picks (the weight fits
            # its panels when the step's rows passed takes()); a bf16 model's on the amx
            # level the AMX kernel above amx_min_rows - 1, on the avx512_bf16 level the
            # vdpbf16ps kernel from one row, in its panel form above DP_FEW_ROWS; up to
            # i8_max_rows rows the 8-bit kernel ahead of all (QuantizedWeight.matmul).
            few_rows = (blocks.amx_min_rows - 1 if blocks.uses_amx
                        else DP_FEW_ROWS if blocks.uses_dp else blocks.max_rows)
            projections[part] = (blocks.kind, blocks.qs, blocks.scales, linear.bias, few_rows,
                                 blocks.uses_amx, blocks.uses_dp, blocks.i8_max_rows,
                                 blocks.i8_weight() if blocks.i8_max_rows else None)
        key_cache, value_cache = TorchSDPABackend.split_kv_cache(kv_cache)
        bound, keep = self.ops.layer(
            projections, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            key_cache, value_cache,
        )
        self._bound[index] = (kv_cache.data_ptr(), bound, keep)
        return bound
