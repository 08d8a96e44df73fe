"""One workload for every parallel layout: greedy requests under forced chunked prefill and
preemption, then prefix-cache hits; the tokens and logprobs each layout gives."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenserve import LLM, SamplingParams

MAX_TOKENS = 12
# 12 blocks of 16 tokens cannot hold all requests at once: without admission lookahead the
# newest are preempted as they grow; 16 tokens a step chunks every longer prompt.
SETTINGS = {
    "num_kv_blocks": 12, "block_size": 16, "max_model_len": 150, "admission_lookahead_tokens": 0,
    "max_num_batched_tokens": 16,
}
PROMPT_LENGTHS = (3, 17, 40, 64, 100)
SHARED_PREFIX = 48  # three whole blocks of 16


@dataclass
class WorkloadResult:
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # each generated token's logprob
    num_preemptions: int
    prefix_cache_hits: int


def prompts(vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the batch, two prompts sharing a prefix, run one after the other)."""
    rng = random.Random(0)
    batch = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    shared = [rng.randrange(3, vocab_size) for _ in range(SHARED_PREFIX)]
    return batch, [shared + [5, 6, 7], shared + [8, 9]]


def run_workload(llm: LLM, vocab_size: int) -> WorkloadResult:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    batch, pair = prompts(vocab_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    preemptions = llm.llm_engine.get_stats().num_preemptions
    for prompt in pair:  # the second finds the first's blocks in the prefix cache
        outputs += llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    token_ids = [list(output.outputs[0].token_ids) for output in outputs]
    logprobs = [
        [step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens)]
        for output, tokens in zip(outputs, token_ids)
    ]
    return WorkloadResult(token_ids, logprobs, preemptions, stats.prefix_cache_hits)


def assert_same_as(
    result: WorkloadResult, reference: WorkloadResult, same_schedule: bool = True
) -> None:
    """The reference's tokens and logprobs. `same_schedule`: also its preemptions and hits
    (tensor parallelism changes nothing the scheduler sees; pipeline stages overlap steps,
    which changes the schedule, so there the run need only preempt and hit as well)."""
    assert reference.num_preemptions > 0 and reference.prefix_cache_hits >= SHARED_PREFIX
    assert result.token_ids == reference.token_ids
    for got, expected in zip(result.logprobs, reference.logprobs):
        assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4
    if same_schedule:
        assert (result.num_preemptions, result.prefix_cache_hits) == (
            reference.num_preemptions, reference.prefix_cache_hits
        )
    else:
        assert result.num_preemptions > 0 and result.prefix_cache_hits >= SHARED_PREFIX


def record_steps_under_way(llm) -> list[int]:
    """After each step sent to the executor, how many were sent and not yet collected."""
    executor = llm.llm_engine.engine_core.executor
    execute, counts, under_way = executor.execute_model, [], [0]

    def collect(result):
        def wrapped():
            under_way[0] -= 1
            return result()
        return wrapped

    def recording(*args, non_block=False, **kwargs):
        output = execute(*args, non_block=non_block, **kwargs)
        under_way[0] += 1
        counts.append(under_way[0])
        if not non_block:
            under_way[0] -= 1
            return output
        output.result = collect(output.result)
        return output

    executor.execute_model = recording
    return counts


def kv_cache_shapes(worker) -> list[tuple[int, ...]]:
    """A worker's KV cache, one shape per layer it holds (collective_rpc pickles this
    function by name to the worker processes)."""
    return [tuple(cache.shape) for cache in worker.model_runner.kv_caches]


def gguf_block_layers(worker) -> int:
    """How many decoder layers of a worker's stage keep their projections' GGUF blocks."""
    layers = worker.model_runner.model.model.layer_stack.layers
    return sum(layer.mlp.down_proj.blocks is not None for layer in layers)
