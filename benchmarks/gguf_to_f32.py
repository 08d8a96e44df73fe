"""Rewrite a GGUF file with every tensor dequantized to float32, its metadata (tokenizer, chat
template, hyperparameters) copied unchanged except `general.file_type`.

This is how llama.cpp gets M0 in the precision tokenserve and vLLM compute in: the weights
are exactly the values gguf's dequantization gives (the ones the other engines multiply by),
stored as F32, so llama.cpp multiplies float32 by float32 instead of rounding activations to
8-bit blocks for Q4_1. Used by run_side_by_side.sh (ENGINES=...,llamacpp).

With `--outtype f16` the matrices are stored as F16 instead (the dequantized values rounded
to float16; the norms stay F32, as llama.cpp's own converter writes them): llama.cpp's
"F16 weights" configuration (ENGINES=...,llamacpp_f16), its fastest on AVX-512 CPUs.

usage: python benchmarks/gguf_to_f32.py IN.gguf OUT.gguf [--outtype f32|f16]
"""

from __future__ import annotations

import sys

import gguf
import numpy as np

from tokenserve.model.gguf_loader import dequantize_tensor

FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}


def convert(source: str, target: str, outtype: str = "f32") -> None:
    if outtype not in FILE_TYPES:
        raise ValueError(f"outtype must be one of {sorted(FILE_TYPES)}, got {outtype!r}.")
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        # The reader's own header fields, and the architecture GGUFWriter already wrote.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        value = field.contents()
        if name == "general.file_type":
            value = int(FILE_TYPES[outtype])
        sub_type = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub_type)
    for tensor in reader.tensors:
        # Under its GGUF name and in its stored row order (no un-permuting, as llama.cpp reads it).
        data = dequantize_tensor(tensor, source).numpy()
        if outtype == "f16" and data.ndim == 2:
            writer.add_tensor(tensor.name, data.astype(np.float16),
                              raw_dtype=gguf.GGMLQuantizationType.F16)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    outtype = "f32"
    if len(args) == 4 and args[2] == "--outtype":
        outtype, args = args[3], args[:2]
    if len(args) != 2 or outtype not in FILE_TYPES:
        sys.exit(__doc__)
    convert(args[0], args[1], outtype)
