"""GGUFLlamaConfig (model/gguf_config.py) reads as transformers' LlamaConfig without importing
transformers: every attribute and property, `to_dict`, `get_text_config`, equality, pickling.
(tests/model/test_loader.py checks it on the default model and on written GGUF files.)"""

from __future__ import annotations

import pickle

import transformers

from tests.entrypoints.test_lazy_imports import imported_after
from tokenserve.model.gguf_config import GGUFLlamaConfig
from tokenserve.model.loader import resolve_model

# PretrainedConfig's properties a GGUF config does not answer: transformers 5's view of a
# per-layer config, which no tokenserve code reads. A property transformers adds later
# shows up here as a failure, to be answered or listed.
UNANSWERED_PROPERTIES = {"per_layer_config"}
# Attributes transformers' own construction sets and a config built from metadata does not:
# its post-init marker, and the version `from_dict` copies in (to_dict writes it for both).
CONSTRUCTION_ONLY = {"_post_init_done", "transformers_version"}


def pretrained_config_properties() -> set[str]:
    base = transformers.PretrainedConfig
    return {name for name in dir(base) if isinstance(getattr(base, name, None), property)}


def assert_answers_as(ours: GGUFLlamaConfig, expected: transformers.PretrainedConfig) -> None:
    """Every attribute and property a PretrainedConfig has answers as `expected`'s does."""
    assert not isinstance(ours, transformers.PretrainedConfig)
    assert ours.to_dict() == expected.to_dict()
    assert ours.model_type == expected.model_type == "llama"
    names = (set(vars(expected)) - CONSTRUCTION_ONLY) | (
        pretrained_config_properties() - UNANSWERED_PROPERTIES
    )
    for name in sorted(names):
        assert getattr(ours, name) == getattr(expected, name), name
    assert ours.get_text_config() is ours
    assert ours.get_text_config(decoder=True) is ours


def test_a_default_gguf_config_answers_as_a_llama_config(default_model_path: str):
    ours = resolve_model(default_model_path).hf_config
    assert isinstance(ours, GGUFLlamaConfig)
    assert_answers_as(ours, transformers.LlamaConfig.from_dict(ours.to_dict()))
    # And as transformers' own LlamaConfig built from the same values, not only from our dict.
    values = {k: v for k, v in ours.to_dict().items() if k not in ("model_type", "transformers_version")}
    direct = transformers.LlamaConfig(**values)
    assert ours.to_dict() == direct.to_dict()


def test_equality_copies_and_pickles_by_value(default_model_path: str):
    ours = resolve_model(default_model_path).hf_config
    again = resolve_model(default_model_path).hf_config
    assert ours == again and ours is not again  # the ready handshake compares the two processes'
    restored = pickle.loads(pickle.dumps(ours))
    assert restored == ours and restored.to_dict() == ours.to_dict()
    restored.vocab_size += 1
    assert restored != ours
    # to_dict is a deep copy: changing it changes nothing in the config.
    dumped = ours.to_dict()
    dumped["rope_parameters"]["rope_theta"] = 1.0
    assert ours.rope_parameters["rope_theta"] != 1.0
    assert ours != transformers.LlamaConfig.from_dict(ours.to_dict())  # another class
    assert ours.name_or_path == default_model_path


def test_reading_a_gguf_config_imports_no_transformers(default_model_path: str):
    modules = imported_after(
        "from tokenserve.model.loader import resolve_model\n"
        f"config = resolve_model({default_model_path!r}).hf_config\n"
        "assert config.to_dict()['transformers_version'] and config.num_labels == 2\n"
    )
    assert sorted(m for m in modules if m.split(".")[0] == "transformers") == []


def test_scaled_rope_initialises_as_with_a_llama_config():
    # Scaled RoPE goes through transformers' initialisers, which call the config's rope methods.
    from tokenserve.model.layers.rotary_embedding import compute_inv_freq

    sizes = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "architectures": ["LlamaForCausalLM"]}
    for rope in (
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 2048},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 1024, "beta_fast": 16.0, "beta_slow": 2.0},
        {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
         "long_factor": [2.0] * 8, "original_max_position_embeddings": 1024},
    ):
        ours = GGUFLlamaConfig(**sizes, rope_parameters=dict(rope))
        expected = transformers.LlamaConfig.from_dict(ours.to_dict())
        assert_answers_as(ours, expected)
        inv_freq, scaling = compute_inv_freq(ours, 16)
        expected_inv_freq, expected_scaling = compute_inv_freq(expected, 16)
        assert inv_freq.tolist() == expected_inv_freq.tolist(), rope
        assert scaling == expected_scaling, rope
        assert ours.rope_parameters == expected.rope_parameters, rope  # standardized alike
