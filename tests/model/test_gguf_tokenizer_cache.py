"""A GGUF model's converted tokenizer read back from its cache entry without AutoTokenizer
(model/gguf_loader.py, `load_cached_tokenizer`): the same tokenizer AutoTokenizer reads from
the entry, without transformers' index of every model; an entry naming another class still
goes through AutoTokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from tokenserve.cache_dir import CACHE_DIR_ENV
from tokenserve.model import gguf_loader
from tokenserve.model.loader import default_model_path

TEXTS = ["What is the capital of France?", "<|im_start|>user\nhé 12345<|im_end|>\n",
         "  tabs\t\tand 日本語 🙂", "<|endoftext|>x"]


def spy_autotokenizer(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The entries AutoTokenizer.from_pretrained is asked for from now on."""
    calls: list[str] = []
    load = transformers.AutoTokenizer.from_pretrained

    def spy(path: str, *args, **kwargs):
        calls.append(path)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    return calls


def assert_same_tokenizer(ours: transformers.PreTrainedTokenizerBase,
                          auto: transformers.PreTrainedTokenizerBase) -> None:
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.special_tokens_map == auto.special_tokens_map
    assert ours.all_special_ids == auto.all_special_ids
    assert ours.init_kwargs == auto.init_kwargs
    assert ours.chat_template == auto.chat_template
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == auto(text).input_ids
        assert ours.decode(ids) == auto.decode(ids)
    messages = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


@pytest.fixture(scope="module")
def default_entry(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default model's converted tokenizer, in a private cache directory."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(root))
        path = default_model_path()
        gguf_loader.load_gguf_tokenizer(path)  # converts and writes the entry
        entry = gguf_loader.tokenizer_cache_dir(path)
    assert os.path.isdir(entry)
    return entry


def test_the_cached_tokenizer_is_the_one_autotokenizer_reads(
    default_entry: str, monkeypatch: pytest.MonkeyPatch
):
    with open(os.path.join(default_entry, "tokenizer_config.json")) as file:
        assert json.load(file)["tokenizer_class"] == "TokenizersBackend"
    auto = transformers.AutoTokenizer.from_pretrained(default_entry, local_files_only=True)
    calls = spy_autotokenizer(monkeypatch)
    assert_same_tokenizer(gguf_loader.load_cached_tokenizer(default_entry), auto)
    assert calls == []


def test_reading_the_cached_tokenizer_skips_transformers_model_index(default_entry: str):
    code = ("import sys\nfrom tokenserve.model.gguf_loader import load_cached_tokenizer\n"
            f"load_cached_tokenizer({default_entry!r})\n"
            "print('transformers.models' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_an_entry_naming_another_class_goes_through_autotokenizer(
    tiny_tokenizer_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    entry = str(tmp_path / "entry")
    gguf_loader._write_tokenizer_cache(tokenizer, entry)
    config_path = os.path.join(entry, "tokenizer_config.json")
    with open(config_path) as file:
        config = json.load(file)
    config["tokenizer_class"] = "GPT2Tokenizer"
    with open(config_path, "w") as file:
        json.dump(config, file)
    auto = transformers.AutoTokenizer.from_pretrained(entry, local_files_only=True)
    calls = spy_autotokenizer(monkeypatch)
    assert_same_tokenizer(gguf_loader.load_cached_tokenizer(entry), auto)
    assert calls == [entry]


def test_the_entry_records_the_added_tokens_and_reads_as_without_them(
    default_entry: str, tmp_path: Path
):
    # tokenizer_config.json carries tokenizer.json's added tokens, so that transformers does
    # not parse the whole tokenizer.json in Python for them; the tokenizer is the one the
    # entry without them gives (the previous format, read the other way).
    with open(os.path.join(default_entry, "tokenizer.json"), encoding="utf-8") as file:
        added_tokens = json.load(file)["added_tokens"]
    with open(os.path.join(default_entry, "tokenizer_config.json"), encoding="utf-8") as file:
        recorded = json.load(file)["added_tokens_decoder"]
    assert added_tokens and recorded == {
        str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added_tokens
    }
    entry = tmp_path / "entry"  # one path for both: it is the tokenizer's name_or_path
    shutil.copytree(default_entry, entry)
    ours = gguf_loader.load_cached_tokenizer(str(entry))
    config_path = entry / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    del config["added_tokens_decoder"]
    config_path.write_text(json.dumps(config), encoding="utf-8")
    assert_same_tokenizer(ours, gguf_loader.load_cached_tokenizer(str(entry)))


def test_a_llama_gguf_converts_without_autotokenizer_to_what_autotokenizer_converts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # AutoTokenizer first builds the file's model config with gguf's GGUFReader (seconds);
    # for a llama-architecture file it then converts with TokenizersBackend, which the
    # loader now calls directly: the same tokenizer, and the same entry on disk.
    path = default_model_path()
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    calls = spy_autotokenizer(monkeypatch)
    ours = gguf_loader.load_gguf_tokenizer(path)
    assert calls == []
    monkeypatch.undo()
    auto = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
    )
    assert_same_tokenizer(ours, auto)
    ours.save_pretrained(tmp_path / "ours")
    auto.save_pretrained(tmp_path / "auto")
    names = sorted(os.listdir(tmp_path / "auto"))
    assert sorted(os.listdir(tmp_path / "ours")) == names
    for name in names:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "auto" / name).read_bytes()


def test_a_gguf_with_a_tokenizer_config_beside_it_converts_through_autotokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A tokenizer_config.json in the file's directory may name another class: AutoTokenizer
    # decides, as before.
    directory = tmp_path / "model"
    directory.mkdir()
    path = directory / "model.gguf"
    os.symlink(default_model_path(), path)
    (directory / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert not gguf_loader._converts_as_tokenizers_backend(str(path))
    calls = spy_autotokenizer(monkeypatch)
    gguf_loader.load_gguf_tokenizer(str(path))
    assert calls == [str(directory)]
