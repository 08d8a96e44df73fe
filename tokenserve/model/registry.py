"""A model built, loaded and made ready.

Which class serves which architecture is model/architectures.py's tables ("module:Class");
a class is imported when a model is built (as vLLM's registry does).
"""

from __future__ import annotations

import logging

import torch

from tokenserve.attention.backend import AttentionBackend
from tokenserve.config import KernelConfig, ModelConfig
from tokenserve.distributed.parallel_state import ModelParallel
from tokenserve.model.architectures import model_class_for
from tokenserve.model.layers.quantization import get_linear_method
from tokenserve.model.layers.weight_loading import copies_submitted_to
from tokenserve.model.load_threads import LoadWorkers, load_threads
from tokenserve.model.loader import iterate_model_weights
from tokenserve.model.precision import activation_dtype
from tokenserve.model.weight_cache import WeightDtypes

logger = logging.getLogger(__name__)


def build_model(
    model_config: ModelConfig,
    attention: AttentionBackend,
    kernel_config: KernelConfig | None = None,
    parallel: ModelParallel | None = None,
) -> torch.nn.Module:
    """The model with its weights allocated, not loaded; its linear layers' quantization
    method chosen from the model's format. `parallel`: this rank's share of it (the llama
    family; several ranks)."""
    model_class = model_class_for(model_config.architecture, model_config.runner)
    kernel_config = kernel_config or KernelConfig()
    extra = {"parallel": parallel} if parallel is not None and parallel.world_size > 1 else {}
    return model_class(
        model_config.hf_config,
        # A bfloat16 model's products are bf16, its activations float32 (model/precision.py).
        dtype=activation_dtype(model_config.dtype),
        attention=attention,
        max_position=model_config.max_model_len,
        linear_method=get_linear_method(
            model_config.format, model_config.torch_dtype, kernel_config
        ),
        kernel_config=kernel_config,
        **extra,
    )


def process_weights_after_loading(
    model: torch.nn.Module, workers: LoadWorkers | None = None, pack: bool = True
) -> None:
    """Each layer's loaded weights into the form its quantization method reads (GGUF blocks
    joined, packed for oneDNN: with pack=False, left to `layers_to_pack`); once, after
    loading, on the model's device. `workers`: the load's threads, a layer each at a time
    (default: this thread)."""
    workers = workers or LoadWorkers(1)
    layers = _quantized_layers(model)
    # The largest first (a tied head's table), so that no worker is left with it at the end.
    layers.sort(key=lambda layer: getattr(layer, "weight", torch.empty(0)).numel(), reverse=True)
    for layer in layers:
        workers.submit(layer.quant_method.process_weights_after_loading, layer, pack)
    workers.wait()


def layers_to_pack(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers whose packing process_weights_after_loading(pack=False) left: each packs
    with `layer.quant_method.pack_weight(layer)`, or itself at its first product that reads
    the packed form."""
    return [layer for layer in _quantized_layers(model)
            if getattr(layer, "packing_pending", False)]


def _quantized_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules()
            if getattr(module, "quant_method", None) is not None]


def get_model(
    model_config: ModelConfig,
    attention: AttentionBackend,
    kernel_config: KernelConfig,
    device: torch.device,
    parallel: ModelParallel | None = None,
    pack_weights: bool = True,
) -> torch.nn.Module:
    """The model built, its weights loaded (GGUF blocks too, for a method that keeps them),
    moved to `device` and processed: ready to run. pack_weights=False leaves oneDNN's
    packing to `layers_to_pack` (an engine's idle time) or to each layer's first product
    that reads it: the same products, off the start."""
    torch.manual_seed(model_config.seed)
    model = build_model(model_config, attention, kernel_config, parallel)
    # A small model's copies and packing on the cores' worker threads (load_threads.py).
    with load_threads(model) as workers:
        with copies_submitted_to(workers.submit):
            # A GGUF model's cached weights come in its parameters' dtypes (no cast at load).
            model.load_weights(iterate_model_weights(model_config.files, WeightDtypes.of(model)))
        workers.wait()
        model = model.to(device).eval()
        process_weights_after_loading(model, workers, pack=pack_weights)
    logger.info("Linear layers: %s.", model.linear_method)
    return model
