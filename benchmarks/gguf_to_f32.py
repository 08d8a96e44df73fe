"""Rewrite a GGUF file with every tensor dequantized to float32, its metadata (tokenizer, chat
template, hyperparameters) copied unchanged except `general.file_type`.

This is how llama.cpp gets M0 in the precision tokenserve and vLLM compute in: the weights
are exactly the values gguf's dequantization gives (the ones the other engines multiply by),
stored as F32, so llama.cpp multiplies float32 by float32 instead of rounding activations to
8-bit blocks for Q4_1. Used by run_side_by_side.sh (ENGINES=...,llamacpp).

usage: python benchmarks/gguf_to_f32.py IN.gguf OUT.gguf
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
from gguf.quants import dequantize


def _field_value(field: gguf.ReaderField):
    """A metadata field's value as GGUFWriter takes it back."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


def convert(source: str, target: str) -> None:
    reader = gguf.GGUFReader(source)
    arch_field = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(target, _field_value(arch_field))
    for name, field in reader.fields.items():
        # The reader's own header fields, and the architecture GGUFWriter already wrote.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        value = _field_value(field)
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub_type = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub_type)
    for tensor in reader.tensors:
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = [int(n) for n in reversed(tensor.shape)]
        writer.add_tensor(tensor.name, data.reshape(shape), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    convert(sys.argv[1], sys.argv[2])
