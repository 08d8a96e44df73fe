"""`GGUFLlamaConfig`: a GGUF file's model config, read as a `LlamaConfig` without transformers.

The engine process of a GGUF model needs the config's numbers, not transformers: importing
transformers' base (`PretrainedConfig` comes with the whole package: hub client, version
checks) is ~0.5 s of the engine process's start on its critical path (docs/STARTUP.md).
This class answers what a `PretrainedConfig` answers where the engine reads a config: the
attributes `LlamaConfig` sets (the file's values, `LlamaConfig`'s defaults for the rest),
the ones `PretrainedConfig.__init__` adds, its properties (`num_labels`, `name_or_path`,
`rope_scaling`, ...), `to_dict`, `get_text_config` and equality by attributes.
tests/model/test_gguf_config.py checks all of it against transformers' own `LlamaConfig`;
a Hugging Face directory keeps transformers' config classes (model/hf_loader.py).
"""

from __future__ import annotations

import copy
import importlib.metadata
from typing import Any, ClassVar

# What LlamaConfig sets that a GGUF file does not say: its defaults (the loader gives the
# rest, the last five included, from the file).
LLAMA_CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True, "pretraining_tp": 1,
    "attention_dropout": 0.0, "mlp_bias": False, "attention_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
}
# What transformers' PretrainedConfig.__init__ sets on every config it builds (transformers
# 5); id2label / label2id are built per instance (mutable).
PRETRAINED_CONFIG_DEFAULTS: dict[str, Any] = {
    "return_dict": True, "output_hidden_states": False, "dtype": None,
    "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "problem_type": None,
    "transformers_version": None, "architectures": None, "_name_or_path": "",
    "_output_attentions": False, "_attn_implementation_internal": None,
    "_experts_implementation_internal": None,
}
# Instance attributes that `to_dict` leaves out, as transformers' does.
_NOT_SERIALIZED = ("_attn_implementation_internal", "_experts_implementation_internal",
                   "_output_attentions")


def _transformers_version() -> str | None:
    """What `PretrainedConfig.to_dict` writes, read from the installed metadata (no import)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _rope_config_mixin() -> Any:
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    return RotaryEmbeddingConfigMixin


class GGUFLlamaConfig:
    """A GGUF file's LlamaConfig, attribute for attribute, without importing transformers."""

    model_type = "llama"
    attribute_map: ClassVar[dict[str, str]] = {}  # LlamaConfig renames nothing
    sub_configs: ClassVar[dict[str, Any]] = {}
    is_composition = False
    # RotaryEmbeddingConfigMixin's class attributes (transformers' RoPE initialisers read them).
    default_theta = 10000.0
    default_rope_type = "default"

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(PRETRAINED_CONFIG_DEFAULTS)
        self.id2label = {0: "LABEL_0", 1: "LABEL_1"}
        self.label2id = {"LABEL_0": 0, "LABEL_1": 1}
        self.__dict__.update(LLAMA_CONFIG_DEFAULTS)
        for key, value in kwargs.items():
            setattr(self, key, value)

    # PretrainedConfig's properties, read the same way.
    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    @name_or_path.setter
    def name_or_path(self, value: str) -> None:
        self._name_or_path = str(value)

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def use_return_dict(self) -> bool:
        return self.return_dict

    @property
    def output_attentions(self) -> bool:
        return self._output_attentions

    @property
    def _attn_implementation(self) -> str | None:
        return self._attn_implementation_internal

    @property
    def _experts_implementation(self) -> str | None:
        return self._experts_implementation_internal

    @property
    def torch_dtype(self) -> Any:
        return self.dtype

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        return self.rope_parameters

    # transformers 5's per-layer ("heterogeneous") configs: a GGUF llama is uniform.
    @property
    def is_heterogeneous(self) -> bool:
        return False

    @property
    def per_layer_attributes(self) -> None:
        return None

    @property
    def allow_global_per_layer_attribute_access(self) -> bool:
        return False

    @property
    def serialize_explicit_per_layer_config(self) -> bool:
        return False

    # transformers' RoPE initialisers for scaled RoPE (linear, llama3, yarn: they import
    # transformers anyway) standardize the config's rope_parameters in place first, with
    # RotaryEmbeddingConfigMixin's methods: the same functions, on this config.
    def standardize_rope_params(self) -> None:
        _rope_config_mixin().standardize_rope_params(self)

    def nested_rope_parameter_keys(self, rope_parameters: dict[str, Any]) -> list[str]:
        return _rope_config_mixin().nested_rope_parameter_keys(self, rope_parameters)

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None):
        """A decoder-only model's text config is itself (as transformers answers)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """The keys and values `LlamaConfig.to_dict` gives for the same config."""
        output = {
            key: copy.deepcopy(value) for key, value in self.__dict__.items()
            if key not in _NOT_SERIALIZED
        }
        output["model_type"] = self.model_type
        output["output_attentions"] = self._output_attentions
        output["transformers_version"] = _transformers_version()
        return output

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        return f"{type(self).__name__} {self.to_dict()}"
