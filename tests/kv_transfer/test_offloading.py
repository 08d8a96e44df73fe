"""--kv-offloading-size: blocks the main KV cache evicted come back from the host pool on a
hit (cached tokens) with the same greedy output, instead of being recomputed; the pool
evicts its least recently used blocks when full."""

from __future__ import annotations

import pytest

from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def prompt(first: int) -> list[int]:
    return list(range(first, first + 3 * BLOCK_SIZE + 3))  # three full blocks


def run(llm: LLM, tokens: list[int]) -> tuple[list[int], int]:
    [output] = llm.generate({"prompt_token_ids": tokens}, GREEDY, use_tqdm=False)
    return output.outputs[0].token_ids, output.num_cached_tokens


def make(model: str, kv_offloading_size: float | None) -> LLM:
    # Eight blocks: the next prompts evict the first one's blocks from the main cache.
    return LLM(model, block_size=BLOCK_SIZE, num_kv_blocks=8, max_num_batched_tokens=64,
               kv_offloading_size=kv_offloading_size)


def test_evicted_blocks_come_back_from_the_host_pool(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    plain = make(model, None)
    offloading = make(model, 0.01)  # 10 MiB: every block of these prompts fits
    for llm, cached_again in ((plain, 0), (offloading, 3 * BLOCK_SIZE)):
        first, cached = run(llm, prompt(10))
        assert cached == 0
        for other in (100, 200, 300):
            run(llm, prompt(other))
        again, cached = run(llm, prompt(10))
        assert again == first
        assert cached == cached_again
    stats = offloading.llm_engine.get_stats().kv_connector_stats
    assert stats.external_prefix_cache_hits == 3 * BLOCK_SIZE
    assert stats.bytes_loaded > 0 and stats.bytes_saved > 0


def test_a_full_pool_evicts_its_least_recently_used_blocks(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    llm = make(model, 0.01)
    scheduler = llm.llm_engine.engine_core.scheduler
    connector = scheduler.kv_connector.connector
    # Shrink the pool to three slots: one prompt's blocks.
    connector.num_slots, connector.free_slots = 3, [2, 1, 0]
    first, _ = run(llm, prompt(10))
    run(llm, prompt(100))  # takes every slot: the first prompt's blocks leave the pool
    for other in (200, 300):
        run(llm, prompt(other))
    again, cached = run(llm, prompt(10))
    assert (again, cached) == (first, 0)


def test_offloading_and_another_connector_are_refused(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="one KV connector"):
        LLM(tiny_model_dirs["llama"], kv_offloading_size=1.0, kv_transfer_config={
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
