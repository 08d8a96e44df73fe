"""BERT pooling models against their references (fp32, within 1e-5): `BertModel`
embeddings equal sentence-transformers' (CLS and mean pooling, normalized), a
`BertForSequenceClassification` cross-encoder's scores equal its logits (and, through the
sigmoid, `CrossEncoder.predict`), classify probabilities equal the softmax of the logits."""

from __future__ import annotations

import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder

from tests.pooling_models import build_bert_cross_encoder, build_bert_st_dir
from tokenserve.entrypoints.llm import LLM
from tokenserve.pooling_params import PoolingParams

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "paris",
    "what is the meaning of life? where do penguins live? most in the southern hemisphere",
]
ENGINE = {"num_kv_blocks": 8, "block_size": 16, "max_num_seqs": 4}


@pytest.mark.parametrize("pooling_mode", ["cls", "mean"])
def test_embeddings_equal_sentence_transformers(tmp_path, pooling_mode):
    reference = build_bert_st_dir(tmp_path, pooling_mode)
    llm = LLM(str(tmp_path / "st"), **ENGINE)
    config = llm.llm_engine.config
    assert config.model_config.runner == "pooling"  # "auto": BertModel pools
    assert config.model_config.pooler_config.pooling_type == pooling_mode.upper()
    # Bidirectional: a prompt is computed whole, nothing comes from a cache.
    assert not config.scheduler_config.enable_chunked_prefill
    assert not config.cache_config.enable_prefix_caching

    outputs = llm.embed(TEXTS, use_tqdm=False)  # the three prompts share one step
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    got = torch.tensor([output.outputs.embedding for output in outputs])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert [o.prompt_token_ids for o in outputs] == [
        reference.tokenizer(text)["input_ids"] for text in TEXTS
    ]
    # normalize=False gives the pooled vector itself, which the reference normalized.
    raw = llm.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    raw_vector = torch.tensor(raw.outputs.embedding)
    assert abs(raw_vector.norm().item() - 1) > 1e-3
    torch.testing.assert_close(raw_vector / raw_vector.norm(), expected[0], atol=1e-5, rtol=0)


def test_cross_encoder_scores_equal_logits(tmp_path):
    model = build_bert_cross_encoder(tmp_path, num_labels=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    query = "where do penguins live"
    documents = ["most in the southern hemisphere", "paris is the capital of france", "the sky"]
    with torch.no_grad():
        batch = tokenizer([query] * 3, documents, return_tensors="pt", padding=True)
        logits = model(**batch).logits[:, 0]

    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.config.model_config.pooling_tasks == ("classify", "score")
    raw = llm.score(query, documents, PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor([r.outputs.score for r in raw]), logits, atol=1e-5, rtol=0
    )
    scores = llm.score(query, documents, use_tqdm=False)
    expected = CrossEncoder(str(tmp_path), device="cpu").predict(
        [(query, document) for document in documents]
    )
    torch.testing.assert_close(
        torch.tensor([s.outputs.score for s in scores]), torch.sigmoid(logits), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        torch.tensor([s.outputs.score for s in scores]), torch.tensor(expected), atol=1e-5, rtol=0
    )
    # Pairwise: text_1[i] with text_2[i]; the pair's second text has token type 1.
    pairwise = llm.score(documents, documents[::-1], use_tqdm=False)
    with torch.no_grad():
        batch = tokenizer(documents, documents[::-1], return_tensors="pt", padding=True)
        pair_logits = model(**batch).logits[:, 0]
    torch.testing.assert_close(
        torch.tensor([s.outputs.score for s in pairwise]), torch.sigmoid(pair_logits),
        atol=1e-5, rtol=0,
    )


def test_classify_probs_equal_softmax_of_logits(tmp_path):
    model = build_bert_cross_encoder(tmp_path, num_labels=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        logits = model(**tokenizer(TEXTS, return_tensors="pt", padding=True)).logits
    llm = LLM(str(tmp_path), **ENGINE)
    outputs = llm.classify(TEXTS, use_tqdm=False)
    assert all(output.outputs.num_classes == 3 for output in outputs)
    torch.testing.assert_close(
        torch.tensor([o.outputs.probs for o in outputs]), logits.softmax(-1), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="does not support the 'embed' task"):
        llm.embed(TEXTS, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.classify(" ".join(["fox"] * 200), use_tqdm=False)
    # Truncated to its first tokens instead, as the tokenizer truncates.
    truncated = llm.classify(
        " ".join(["fox"] * 200), PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False
    )[0]
    assert len(truncated.prompt_token_ids) == 128
