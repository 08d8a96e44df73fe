"""Tensors as `TensorData` (dtype name, shape, raw bytes): what msgpack carries to the engine
core, and back to tensors on the worker."""

from __future__ import annotations

import torch

from tokenserve.messages.multimodal import TensorData


def to_tensor_data(tensor: torch.Tensor) -> TensorData:
    tensor = tensor.detach().contiguous().cpu()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return TensorData(dtype, list(tensor.shape), tensor.numpy().tobytes())


def from_tensor_data(data: TensorData) -> torch.Tensor:
    dtype = getattr(torch, data.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown tensor dtype {data.dtype!r}.")
    if not data.buffer:
        return torch.empty(data.shape, dtype=dtype)
    # bytearray: a writable copy, so the tensor owns its memory.
    return torch.frombuffer(bytearray(data.buffer), dtype=dtype).reshape(data.shape)
