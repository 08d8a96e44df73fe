"""Decoder models (Llama, Mistral, Qwen2, Qwen3) as pooling models, as vLLM converts them:
the layer stack without its LM head, its last hidden states pooled by the runner (the last
token by default; mean where sentence-transformers says so), and for
`*ForSequenceClassification` a `score` projection to the labels.

Subclasses of the causal LM, so weights load through the same merged layers and loaders;
checkpoint names come as `model.*` (causal LM, classifier) or bare (a sentence-transformers
`Qwen3Model` / `LlamaModel` directory), and an LM head that is present is not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from tokenserve.model.layers.linear import ReplicatedLinear
from tokenserve.model.llama import LlamaForCausalLM, LlamaModel
from tokenserve.model.qwen3 import Qwen3Model


class LlamaForEmbedding(LlamaForCausalLM):
    is_encoder_only: ClassVar[bool] = False
    default_pooling_type: ClassVar[str] = "LAST"
    pooling_tasks: ClassVar[tuple[str, ...]] = ("embed",)
    # Top-level tensors of the checkpoint that are this model's own (not under `model.`).
    head_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, hf_config, dtype, attention, max_position, linear_method, kernel_config):
        nn.Module.__init__(self)  # the causal LM's layers, without its LM head
        self.config = hf_config
        self.dtype = dtype
        self.linear_method = linear_method
        self.model = self.model_class(
            hf_config, dtype, attention, max_position, linear_method, kernel_config
        )
        self.tie_word_embeddings = False

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError("A pooling model computes no logits over the vocabulary.")

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        super().load_weights(self._own_weights(weights))

    def _own_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        for name, weight in weights:
            if name.startswith("lm_head."):
                continue
            if not name.startswith("model.") and not name.startswith(self.head_prefixes):
                name = "model." + name  # a bare base-model checkpoint
            yield name, weight


class Qwen3ForEmbedding(LlamaForEmbedding):
    model_class: ClassVar[type[LlamaModel]] = Qwen3Model


class LlamaForSequenceClassification(LlamaForEmbedding):
    """The last token's hidden state → `score` (no bias) → one logit per label."""

    pooling_tasks: ClassVar[tuple[str, ...]] = ("classify", "score")
    head_prefixes: ClassVar[tuple[str, ...]] = ("score.",)

    def __init__(self, hf_config, dtype, attention, max_position, linear_method, kernel_config):
        super().__init__(hf_config, dtype, attention, max_position, linear_method, kernel_config)
        self.score = ReplicatedLinear(
            hf_config.hidden_size, hf_config.num_labels, quant_method=linear_method,
            params_dtype=dtype,
        )

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    model_class: ClassVar[type[LlamaModel]] = Qwen3Model
