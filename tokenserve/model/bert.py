"""BERT encoders: `BertModel` (embeddings, sentence-transformers' CLS or mean pooling) and
`BertForSequenceClassification` (cross-encoders: the pooler's tanh layer, then the classifier).

Encoder-only: attention is bidirectional within each prompt and keeps no KV cache, so a
prompt is computed whole in one step (the engine turns chunked prefill and prefix caching
off for these models). Post-LN layers, absolute position and token type embeddings. The
module names follow the checkpoint's, so weights load by name; q/k/v are one merged layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenserve.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tokenserve.model.layers.quantization import QuantizationMethod
from tokenserve.model.layers.vocab_parallel_embedding import VocabParallelEmbedding
from tokenserve.model.layers.weight_loading import default_weight_loader

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _activation(config):
    act = config.hidden_act
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"BERT hidden_act {act!r} is not supported; supported: {list(_ACTIVATIONS)}."
        )
    return _ACTIVATIONS[act]


class BertEmbeddings(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        position_type = getattr(config, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"BERT position_embedding_type {position_type!r} is not supported.")
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden, params_dtype=dtype)
        self.position_embeddings = VocabParallelEmbedding(
            config.max_position_embeddings, hidden, params_dtype=dtype
        )
        self.token_type_embeddings = VocabParallelEmbedding(
            config.type_vocab_size, hidden, params_dtype=dtype
        )
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps, dtype=dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        embeddings = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(positions)
        )
        return self.LayerNorm(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config, linear_method: QuantizationMethod, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_heads, bias=True,
            quant_method=linear_method, params_dtype=dtype,
        )

    def forward(self, hidden_states: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        num_tokens, hidden = hidden_states.shape
        qkv = self.qkv_proj(hidden_states).view(num_tokens, 3, self.num_heads, self.head_dim)
        output = torch.empty_like(hidden_states)
        # Each prompt attends to itself only, every position to every other (no causal mask).
        for start, end in itertools.pairwise(query_start_loc):
            q, k, v = qkv[start:end].permute(1, 2, 0, 3)  # each [heads, len, head_dim]
            attended = F.scaled_dot_product_attention(q, k, v)
            output[start:end] = attended.transpose(0, 1).reshape(end - start, hidden)
        return output


class BertDenseLayerNorm(nn.Module):
    """dense → residual add → LayerNorm: BERT's post-LN sublayer output."""

    def __init__(self, config, input_size: int, linear_method, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = RowParallelLinear(
            input_size, config.hidden_size, bias=True, quant_method=linear_method,
            params_dtype=dtype,
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config, linear_method, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, linear_method, dtype)
        self.output = BertDenseLayerNorm(config, config.hidden_size, linear_method, dtype)

    def forward(self, hidden_states: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        return self.output(self.self(hidden_states, query_start_loc), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config, linear_method, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, bias=True,
            quant_method=linear_method, params_dtype=dtype,
        )
        self.act = _activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config, linear_method, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(config, linear_method, dtype)
        self.intermediate = BertIntermediate(config, linear_method, dtype)
        self.output = BertDenseLayerNorm(config, config.intermediate_size, linear_method, dtype)

    def forward(self, hidden_states: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        attention_output = self.attention(hidden_states, query_start_loc)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config, linear_method, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(config, linear_method, dtype) for _ in range(config.num_hidden_layers)
        )

    def forward(self, hidden_states: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states, query_start_loc)
        return hidden_states


class BertPooler(nn.Module):
    """The [CLS] vector through a dense layer and tanh (the classification models' input)."""

    def __init__(self, config, linear_method, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(
            config.hidden_size, config.hidden_size, bias=True, quant_method=linear_method,
            params_dtype=dtype,
        )

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


class BertEncoderModel(nn.Module):
    """The encoder stack, named as the checkpoint's `bert.` / top-level modules."""

    def __init__(self, config, linear_method, dtype: torch.dtype, with_pooler: bool) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config, dtype)
        self.encoder = BertEncoder(config, linear_method, dtype)
        self.pooler = BertPooler(config, linear_method, dtype) if with_pooler else None

    def forward(self, input_ids, positions, token_type_ids, query_start_loc) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids, positions, token_type_ids)
        return self.encoder(hidden_states, query_start_loc)


# Checkpoint projections → (the merged layer, its shard).
_PACKED = {".query.": ("qkv_proj", "q"), ".key.": ("qkv_proj", "k"), ".value.": ("qkv_proj", "v")}


class BertPoolingModel(nn.Module):
    """What both BERT pooling models share: the encoder forward and loading by name."""

    is_encoder_only: ClassVar[bool] = True
    default_pooling_type: ClassVar[str] = "CLS"
    pooling_tasks: ClassVar[tuple[str, ...]] = ("embed",)
    # The checkpoint's prefix of the encoder's tensors ("" for a bare BertModel).
    checkpoint_prefix: ClassVar[str] = ""

    def __init__(self, hf_config, dtype, attention, max_position, linear_method, kernel_config):
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.linear_method = linear_method

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata,
        *,
        token_type_ids: torch.Tensor,
        query_start_loc: list[int],
    ) -> torch.Tensor:
        """Hidden states of every position; `kv_caches` and `metadata` are unused: the whole
        prompt is here, and nothing is kept for later steps."""
        return self.bert(input_ids, positions, token_type_ids, query_start_loc)

    def _checkpoint_to_param(self, name: str) -> tuple[str | None, str | None]:
        """The parameter (and shard) a checkpoint tensor loads into; None: not used here."""
        prefix = self.checkpoint_prefix
        if prefix and not name.startswith(prefix) and not name.startswith("classifier."):
            name = prefix + name  # a bare BertModel checkpoint under a classifier
        if name.startswith(prefix):
            name = "bert." + name[len(prefix):]
        for part, (merged, shard_id) in _PACKED.items():
            if part in name:
                return name.replace(part, f".{merged}."), shard_id
        return name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | None]] = set()
        for name, loaded_weight in weights:
            if name.endswith(("position_ids", "token_type_ids")):
                continue  # buffers some checkpoints carry
            param_name, shard_id = self._checkpoint_to_param(name)
            param = params.get(param_name) if param_name else None
            if param is None:
                if ".pooler." in f".{param_name}":
                    continue  # the embedding model does not use BERT's pooler layer
                raise ValueError(f"Unexpected tensor {name!r} in the checkpoint.")
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, loaded_weight, shard_id)
            except ValueError as error:
                raise ValueError(f"Tensor {name!r}: {error}.") from None
            loaded.add((param_name, shard_id))
        needed = {
            (name, shard) for name in params
            for shard in (("q", "k", "v") if ".qkv_proj." in name else (None,))
        }
        missing = sorted(f"{name} {shard or ''}".strip() for name, shard in needed - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"The checkpoint is missing {len(missing)} tensor(s): {shown}")


class BertModel(BertPoolingModel):
    """Sentence embeddings: the encoder's hidden states, pooled by the runner (CLS by default,
    or as the sentence-transformers directory says)."""

    def __init__(self, hf_config, dtype, attention, max_position, linear_method, kernel_config):
        super().__init__(hf_config, dtype, attention, max_position, linear_method, kernel_config)
        self.bert = BertEncoderModel(hf_config, linear_method, dtype, with_pooler=False)

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled


class BertForSequenceClassification(BertPoolingModel):
    """Cross-encoders and classifiers: [CLS] → pooler (dense, tanh) → classifier → logits."""

    pooling_tasks: ClassVar[tuple[str, ...]] = ("classify", "score")
    checkpoint_prefix: ClassVar[str] = "bert."

    def __init__(self, hf_config, dtype, attention, max_position, linear_method, kernel_config):
        super().__init__(hf_config, dtype, attention, max_position, linear_method, kernel_config)
        self.bert = BertEncoderModel(hf_config, linear_method, dtype, with_pooler=True)
        self.classifier = ReplicatedLinear(
            hf_config.hidden_size, hf_config.num_labels, bias=True, quant_method=linear_method,
            params_dtype=dtype,
        )

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(pooled))
