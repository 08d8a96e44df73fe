"""tokenserve.model.gguf_file: the header read without the vocabulary's strings, against gguf's
own GGUFReader (a hand-written file with every value type, and the default model); the
format's codes it keeps are gguf's, and a file's header is read without importing gguf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from tokenserve.model import gguf_file
from tokenserve.model.gguf_file import GGUFFile, StringArray


def write_gguf(path: Path, every_kind: bool = True) -> None:
    """every_kind=False: only the tensor types gguf_file knows without gguf."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.u32", 7)
    writer.add_int32("test.i32", -3)
    writer.add_float32("test.f32", 0.1)
    writer.add_float64("test.f64", 0.1)
    writer.add_bool("test.bool", True)
    writer.add_uint64("test.u64", 2**40)
    writer.add_string("test.string", "héllo")
    writer.add_token_list(["a", "bc", "<|im_end|>", "日本"])
    writer.add_token_scores([0.0, -1.5, 2.0, 3.5])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_tensor("blk.0.attn_q.weight",
                      quantize(rng.standard_normal((4, 64)).astype(np.float32),
                               gguf.GGMLQuantizationType.Q4_1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("token_embd.weight", rng.standard_normal((5, 32)).astype(np.float16))
    writer.add_tensor("blk.0.attn_k.weight",
                      quantize(rng.standard_normal((2, 64)).astype(np.float32),
                               gguf.GGMLQuantizationType.BF16),
                      raw_dtype=gguf.GGMLQuantizationType.BF16)
    if every_kind:  # a type outside gguf_file's own table: its sizes come from gguf's
        writer.add_tensor("blk.0.attn_v.weight",
                          rng.integers(0, 256, (3, 2 * 18), dtype=np.uint8),
                          raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_as_reader(ours: GGUFFile, reader: gguf.GGUFReader) -> None:
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert sorted(ours.metadata) == sorted(fields)
    for key, field in fields.items():
        value = ours.metadata[key]
        if isinstance(value, StringArray):
            assert len(value) == len(field.data), key
        elif isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, field.contents(), err_msg=key)
        else:
            assert value == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert list(mine.shape) == [int(d) for d in theirs.shape], mine.name
        assert (mine.data_offset, mine.n_bytes) == (theirs.data_offset, theirs.n_bytes), mine.name
        assert mine.data.shape == theirs.data.shape and mine.data.dtype == theirs.data.dtype
        np.testing.assert_array_equal(mine.data, theirs.data, err_msg=mine.name)


def test_every_value_type_and_tensor_kind(tmp_path: Path):
    path = tmp_path / "all.gguf"
    write_gguf(path)
    ours = GGUFFile(str(path))
    assert_same_as_reader(ours, gguf.GGUFReader(str(path)))
    assert ours.get("test.string") == "héllo" and ours.get("test.bool") is True
    assert len(ours.get("tokenizer.ggml.tokens")) == 4
    assert ours.get("missing", "default") == "default"


def test_default_model_header_matches_gguf_reader(default_model_path: str):
    assert_same_as_reader(GGUFFile(default_model_path), gguf.GGUFReader(default_model_path))


@pytest.mark.parametrize("cut", [0, 3, 100])
def test_cut_files_are_value_errors_naming_the_file(tmp_path: Path, cut: int):
    path = tmp_path / "all.gguf"
    write_gguf(path)
    cut_path = tmp_path / "cut.gguf"
    cut_path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ValueError, match=str(cut_path)):
        GGUFFile(str(cut_path))


def test_not_a_gguf_file(tmp_path: Path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))


def test_the_format_codes_kept_are_ggufs():
    assert {t.name: t.value for t in gguf_file.ValueType} == {
        t.name: t.value for t in gguf.GGUFValueType
    }
    for code, sizes in gguf_file._TYPE_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(code)] == sizes, code
    plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
             "I16": np.int16, "I32": np.int32, "I64": np.int64}
    assert {gguf.GGMLQuantizationType(code).name: dtype
            for code, dtype in gguf_file._PLAIN_TENSOR_TYPES.items()} == plain


def test_a_header_is_read_without_importing_gguf(tmp_path: Path):
    path = tmp_path / "known.gguf"
    write_gguf(path, every_kind=False)
    script = (
        "import sys\n"
        "from tokenserve.model.gguf_file import GGUFFile\n"
        f"header = GGUFFile({str(path)!r})\n"
        "assert len(header.tensors) == 4 and header.get('test.u32') == 7\n"
        "print('gguf' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
