"""benchmarks/gguf_to_f32.py on a small hand-written GGUF with block-quantized tensors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from tests.benchmarks.scripts import load_script


def metadata(reader: gguf.GGUFReader) -> dict:
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_tensors_become_their_dequantized_values_and_metadata_stays(tmp_path: Path, outtype: str):
    rng = np.random.default_rng(0)
    weights = {
        "blk.0.attn_q.weight": (rng.standard_normal((8, 64)), gguf.GGMLQuantizationType.Q4_1),
        "blk.0.ffn_down.weight": (rng.standard_normal((4, 96)), gguf.GGMLQuantizationType.Q8_0),
        "output_norm.weight": (rng.standard_normal(64), gguf.GGMLQuantizationType.F32),
    }
    source = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_block_count(1)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "<|im_end|>"])
    writer.add_token_scores([0.0, -1.5, 2.0])
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for name, (values, kind) in weights.items():
        values = values.astype(np.float32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    target = tmp_path / "model-f32.gguf"
    script = load_script("gguf_to_f32")
    script.convert(str(source), str(target), outtype)

    before, after = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(target))
    expected = metadata(before)
    assert expected["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_1)
    expected["general.file_type"] = int(script.FILE_TYPES[outtype])
    assert metadata(after) == expected
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for old, new in zip(before.tensors, after.tensors):
        # f16: the matrices rounded to float16, the norms kept in float32 (as llama.cpp's own
        # converter writes an F16 model).
        half = outtype == "f16" and len(old.shape) == 2
        kind = gguf.GGMLQuantizationType.F16 if half else gguf.GGMLQuantizationType.F32
        assert new.tensor_type == kind, new.name
        assert list(new.shape) == list(old.shape), new.name
        values = dequantize(old.data, old.tensor_type).reshape(-1)
        np.testing.assert_array_equal(
            np.asarray(new.data).reshape(-1),
            values.astype(np.float16) if half else values,
            err_msg=new.name,
        )
    # The quantized tensors changed: the check above compared dequantized values, not bytes.
    assert before.tensors[0].tensor_type == gguf.GGMLQuantizationType.Q4_1
