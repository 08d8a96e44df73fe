"""Tiny random pooling models built at test time: BERT (a WordPiece tokenizer, a
`BertModel` saved as a sentence-transformers directory, a `BertForSequenceClassification`
cross-encoder) and Qwen3 (a `Qwen3Model` sentence-transformers directory, a causal LM).
fp32, seeded, saved with safetensors; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

from tests.conftest import TINY_INITIALIZER_RANGE, write_tiny_tokenizer

_TRAINING_WORDS = (
    "the quick brown fox jumps over lazy dog a journey of thousand miles begins with single "
    "step capital france is paris and italy rome water boils at degrees what meaning life "
    "where do penguins live most in southern hemisphere why sky blue because air scatters"
)
_WORDS = _TRAINING_WORDS.split()


def write_bert_tokenizer(directory: str | Path) -> transformers.PreTrainedTokenizerBase:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(_WORDS))]
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab += list(letters + "0123456789.,?!'") + [f"##{c}" for c in letters]
    Path(directory).mkdir(parents=True, exist_ok=True)
    vocab_file = Path(directory) / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(str(vocab_file), model_max_length=128)
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def bert_config(vocab_size: int, **extra) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, initializer_range=0.2, **extra,
    )


def build_bert_st_dir(
    directory: Path, pooling_mode: str, normalize: bool = True
) -> SentenceTransformer:
    """A BertModel as a sentence-transformers directory at `directory`; returns the model."""
    base = directory / "base"
    tokenizer = write_bert_tokenizer(base)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = transformers.BertModel(bert_config(len(tokenizer)))
    model.save_pretrained(str(base))
    return _save_st(base, directory / "st", 32, pooling_mode, normalize)


def build_bert_cross_encoder(directory: Path, num_labels: int) -> transformers.PreTrainedModel:
    tokenizer = write_bert_tokenizer(directory)
    with torch.random.fork_rng():
        torch.manual_seed(4 + num_labels)
        config = bert_config(len(tokenizer), num_labels=num_labels)
        model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(str(directory))
    return model


def qwen3_config(vocab_size: int, **extra) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=TINY_INITIALIZER_RANGE, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, **extra,
    )


def build_qwen3_st_dir(
    directory: Path, pooling_mode: str, **config_extra
) -> SentenceTransformer:
    """A Qwen3Model (Qwen3-Embedding style) as a sentence-transformers directory."""
    base = directory / "base"
    tokenizer = write_tiny_tokenizer(directory / "tokenizer")
    # Without a chat template: sentence-transformers would otherwise wrap each text in it.
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(base))
    with torch.random.fork_rng():
        torch.manual_seed(5)
        model = transformers.Qwen3Model(qwen3_config(len(tokenizer), **config_extra))
    model.save_pretrained(str(base))
    return _save_st(base, directory / "st", 64, pooling_mode, normalize=True)


def _save_st(
    base: Path, target: Path, dimension: int, pooling_mode: str, normalize: bool
) -> SentenceTransformer:
    modules = [Transformer(str(base)), Pooling(dimension, pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu")
    model.save(str(target))
    return model
