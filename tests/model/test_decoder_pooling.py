"""Causal LMs under the pooling runner (vLLM's conversion) and decoder classifiers:
a Llama / Qwen2 checkpoint's embedding is its last token's final hidden state, normalized
(vLLM's default without a sentence-transformers directory), or the mean with
--pooler-config; a Qwen2ForSequenceClassification's probabilities are the softmax of
transformers' logits (the last token through `score`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.conftest import tiny_model_config
from tokenserve.entrypoints.llm import LLM
from tokenserve.pooling_params import PoolingParams

TEXTS = ["Hello, world! How are you today?", "The capital of France is Paris.", "Why"]
ENGINE = {"num_kv_blocks": 16, "block_size": 16, "max_num_batched_tokens": 8}


def _hidden_states(model_dir: str, text_ids: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in text_ids]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_causal_lm_embeddings(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    llm = LLM(model_dir, runner="pooling", **ENGINE)
    outputs = llm.embed(TEXTS, use_tqdm=False)  # chunked: 8 tokens a step
    hidden = _hidden_states(model_dir, [o.prompt_token_ids for o in outputs])
    expected = torch.stack([F.normalize(h[-1], dim=-1) for h in hidden])
    got = torch.tensor([o.outputs.embedding for o in outputs])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

    mean = LLM(model_dir, runner="pooling", pooler_config='{"pooling_type": "MEAN"}', **ENGINE)
    outputs = mean.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False)
    expected = torch.stack([h.mean(dim=0) for h in hidden])
    got = torch.tensor([o.outputs.embedding for o in outputs])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_qwen2_sequence_classification(tmp_path, tiny_tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = tiny_model_config("qwen2", vocab_size=len(tokenizer))
    config.num_labels = 3
    config.architectures = ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng():
        torch.manual_seed(9)
        model = transformers.Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.config.model_config.runner == "pooling"
    outputs = llm.classify(TEXTS, use_tqdm=False)
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([o.prompt_token_ids])).logits for o in outputs])
    got = torch.tensor([o.outputs.probs for o in outputs])
    torch.testing.assert_close(got, logits.softmax(dim=-1), atol=1e-5, rtol=0)
