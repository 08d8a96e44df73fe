"""Greedy sampling of float32 and bfloat16 logits (a bf16 LM head hands bf16): the same
tokens as `argmax` of the float32 values, ties and NaN included, with and without a
processor in the way."""

from __future__ import annotations

import pytest
import torch

from tokenserve.sample.logits_processors import BannedTokens, LogitsProcessorInputs
from tokenserve.sample.sampler import Sampler, SamplingMetadata, greedy_tokens


def _greedy_metadata(rows: int, processors: LogitsProcessorInputs | None = None,
                     max_num_logprobs: int | None = None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(rows),
        greedy=torch.ones(rows, dtype=torch.bool),
        all_greedy=True,
        top_k=None,
        top_p=None,
        processors=processors or LogitsProcessorInputs(),
        max_num_logprobs=max_num_logprobs,
    )


def _tied_logits(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * vocab)
    # Few distinct values: most rows have several equal maxima.
    logits = torch.randint(-4, 4, (rows, vocab), generator=generator).to(dtype)
    logits[1, 7] = float("nan")  # NaN wins, as argmax has it
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmax_first_of_ties(dtype):
    logits = _tied_logits(64, 4099, dtype)
    assert torch.equal(greedy_tokens(logits), logits.float().argmax(dim=-1))


def test_bf16_logits_sample_the_float32_tokens():
    logits = torch.randn(33, 1000, generator=torch.Generator().manual_seed(1)) * 5
    bf16 = logits.to(torch.bfloat16)
    out = Sampler()(bf16, _greedy_metadata(33))
    assert out.logprobs is None
    assert torch.equal(out.token_ids, bf16.float().argmax(dim=-1))
    # The logits are not changed in place by the sampler.
    assert torch.equal(bf16, logits.to(torch.bfloat16))


def test_a_processor_or_logprobs_still_apply_to_bf16_logits():
    logits = torch.zeros(2, 50, dtype=torch.bfloat16)
    logits[:, 3] = 2.0
    logits[:, 9] = 1.0
    banned = BannedTokens(rows=torch.tensor([0]), token_ids=torch.tensor([3]))
    out = Sampler()(logits, _greedy_metadata(2, LogitsProcessorInputs(banned=banned)))
    assert out.token_ids.tolist() == [9, 3]
    assert logits[0, 3] == 2.0  # banned on the sampler's float32 copy only

    out = Sampler()(logits, _greedy_metadata(2, max_num_logprobs=1))
    assert out.token_ids.tolist() == [3, 3]
    assert out.logprobs is not None
    expected = logits.float().log_softmax(-1)[:, 3]
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], expected)


def test_the_c_argmax_samples_what_greedy_tokens_does():
    from tokenserve.kernels import layer_ops

    ops = layer_ops.load()
    if ops is None:
        pytest.skip("the C kernels are not built here")
    sampler = Sampler(ops.argmax_rows)
    logits = _tied_logits(64, 4099, torch.float32)
    assert torch.equal(sampler(logits, _greedy_metadata(64)).token_ids, greedy_tokens(logits))
    # With a processor in the way (the sampler's float32 copy), and on bf16 logits.
    banned = BannedTokens(rows=torch.tensor([0]), token_ids=logits[0].argmax().reshape(1))
    out = sampler(logits, _greedy_metadata(64, LogitsProcessorInputs(banned=banned)))
    assert torch.equal(out.token_ids, Sampler()(logits, _greedy_metadata(
        64, LogitsProcessorInputs(banned=banned))).token_ids)
    bf16 = logits.to(torch.bfloat16)
    assert torch.equal(sampler(bf16, _greedy_metadata(64)).token_ids, greedy_tokens(bf16))
