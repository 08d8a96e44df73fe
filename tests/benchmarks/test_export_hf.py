"""benchmarks/export_hf.py: a GGUF written out as a HF directory runs the same in transformers."""

from __future__ import annotations

import json

import torch
import transformers

from tests.benchmarks.scripts import load_script
from tests.model.test_loader import _write_gguf
from tokenserve import LLM, SamplingParams


def load_export_script():
    return load_script("export_hf")


def test_exported_gguf_gives_tokenserves_greedy_tokens(tiny_model_dirs, tiny_tokenizer_dir, tmp_path):
    source = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"])
    gguf_path = _write_gguf(tmp_path / "tiny.gguf", source.config, source.state_dict())
    out_dir = tmp_path / "hf"

    rc = load_export_script().main(
        [str(out_dir), "--model", gguf_path, "--tokenizer", tiny_tokenizer_dir]
    )

    assert rc == 0
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    prompt = tokenizer.encode("The capital of France is")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    with torch.inference_mode():
        generated = exported.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )[0, len(prompt):].tolist()

    llm = LLM(gguf_path, tokenizer=tiny_tokenizer_dir, kv_cache_memory="16MiB")
    [output] = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert list(output.outputs[0].token_ids) == generated


def test_missing_model_is_an_error(tmp_path, capsys):
    rc = load_export_script().main([str(tmp_path / "out"), "--model", str(tmp_path / "nope")])

    assert rc == 2
    assert "does not exist" in capsys.readouterr().err
