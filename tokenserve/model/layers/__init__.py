"""The building blocks of the models: parallel linear layers and the vocabulary embedding
and LM head (each parameter with a `weight_loader(param, loaded_weight, shard_id)` that puts
its tensor-parallel rank's part of a checkpoint tensor in place), the quantization methods
their weights live in, and RMSNorm, SwiGLU, rotary embeddings and attention as modules.
The C kernels of the CPU path sit behind these modules; a model file only composes them.
"""
