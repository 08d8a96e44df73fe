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

from tokenserve.model.gguf_loader import dequantize_tensor


def convert(source: str, target: str) -> None:
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        # The reader's own header fields, and the architecture GGUFWriter already wrote.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        value = field.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub_type = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub_type)
    for tensor in reader.tensors:
        # Under its GGUF name and in its stored row order (no un-permuting, as llama.cpp reads it).
        data = dequantize_tensor(tensor, source).numpy()
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    convert(sys.argv[1], sys.argv[2])
