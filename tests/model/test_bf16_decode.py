"""A bfloat16 GGUF model's decode steps above `bf16_quantized_max_rows` rows: their products
leave the GGUF block kernels for oneDNN's bf16 GEMM, the one prefill uses.

Tolerance. Both sides of the comparison are tokenserve: the bf16 engine, and the float32
engine teacher-forced on the same tokens. A prompt's positions (prefill) already run the bf16
products, so their typical (median) |Δlogprob| against float32 is the scale of this model's
bf16 error (its maximum is an outlier of a near-flat position: ~2.7 nats against a median
of ~0.04 here). The decode positions run the same products (the same bf16 weights, float32
accumulation) and besides read their context from the bf16 cache, which prefill's own
attention does not: their median must stay within twice the prefill's (~0.05 here).
"""

from __future__ import annotations

import pytest
import torch

from tokenserve import LLM, SamplingParams
from tokenserve.benchmarks.datasets import random_token_prompts

# The limit set low (its default depends on the CPU: 128 on amx, 16 elsewhere), so that
# the decode steps of NUM_PROMPTS rows are above it on every host.
MAX_BLOCK_ROWS = 12
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = MAX_BLOCK_ROWS + 4, 16, 4


@pytest.fixture
def block_rows(block_rows_where) -> list[int]:
    """The rows of every product that read GGUF blocks."""
    return block_rows_where(lambda weight: True)


def _logprobs(output, tokens: list[int]) -> torch.Tensor:
    """The logprob the engine gave tokens[p], p >= 1 (prompt, then output positions)."""
    entries = list(output.prompt_logprobs)[1:] + list(output.outputs[0].logprobs or [])
    return torch.tensor([entries[p - 1][tokens[p]].logprob for p in range(1, len(tokens))])


def test_bf16_decode_steps_above_the_limit_take_the_bf16_products(block_rows):
    prompts = random_token_prompts(NUM_PROMPTS, PROMPT_LEN, 49152, seed=5)
    bf16 = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False,
               bf16_quantized_max_rows=MAX_BLOCK_ROWS)
    (model,) = bf16.llm_engine.collective_rpc(lambda worker: worker.model_runner.model)
    assert model.model.layer_stack.max_rows == MAX_BLOCK_ROWS
    outputs = bf16.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1,
                       prompt_logprobs=1),
        use_tqdm=False,
    )
    # Only products within the limit read the blocks (the prompt logprobs' logits, request by
    # request), none of the decode steps' rows.
    assert max(block_rows, default=0) <= MAX_BLOCK_ROWS
    sequences = [prompt + list(out.outputs[0].token_ids) for prompt, out in zip(prompts, outputs)]

    fp32 = LLM(dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False)
    forced = fp32.generate(
        [{"prompt_token_ids": tokens} for tokens in sequences],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    prefill_error, decode_error = [], []
    for tokens, ours, reference in zip(sequences, outputs, forced):
        # Entry i is position i + 1's: up to the first output token from the prefill step.
        error = (_logprobs(ours, tokens) - _logprobs(reference, tokens)).abs()
        prefill_error.append(error[:PROMPT_LEN])
        decode_error.append(error[PROMPT_LEN:])
    prefill_scale = torch.cat(prefill_error).median().item()
    decode_scale = torch.cat(decode_error).median().item()
    assert prefill_scale > 1e-3, prefill_scale  # bf16 did round
    assert decode_scale <= 2 * prefill_scale, (decode_scale, prefill_scale)
