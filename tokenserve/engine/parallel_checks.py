"""What tensor and pipeline parallelism take, checked when the configuration is made: the
model's heads, vocabulary and layers split evenly, and no feature the ranks do not split yet."""

from __future__ import annotations

from typing import Any

from tokenserve.config import ModelConfig, ParallelConfig, SpeculativeConfig


def check_parallel_model(
    parallel_config: ParallelConfig,
    model_config: ModelConfig,
    engine_args: Any,
    speculative_config: SpeculativeConfig | None,
) -> None:
    """ValueError for a feature not built for several ranks (pooling, LoRA, speculative
    decoding, vision-language models) or a split the model does not allow."""
    if parallel_config.world_size == 1:
        return
    unsupported = {
        "the pooling runner": model_config.runner == "pooling",
        "enable_lora": engine_args.enable_lora,
        "speculative decoding": speculative_config is not None,
        "a vision-language model": model_config.multimodal_config is not None,
    }
    for feature, asked in unsupported.items():
        if asked:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {parallel_config.world_size} "
                f"does not support {feature} yet; run it on one rank."
            )
    parallel_config.check_model(
        model_config.text_config.num_attention_heads, model_config.num_kv_heads,
        model_config.num_layers, model_config.vocab_size,
    )
