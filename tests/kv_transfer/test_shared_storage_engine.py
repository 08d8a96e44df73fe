"""SharedStorageConnector end to end, offline, on the tiny llama: a second engine on the same
directory (a restart) reports the stored prompt as cached tokens and gives the same greedy
output as an engine without a connector; a corrupt file is skipped; another salt sees nothing.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from tokenserve.entrypoints.llm import LLM
from tokenserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
# Three full blocks and a partial one: at most three blocks can come from the store.
PROMPT = list(range(3, 3 + 3 * BLOCK_SIZE + 5))
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_llm(model: str, storage: Path | None) -> LLM:
    kv_transfer_config = None
    if storage is not None:
        kv_transfer_config = {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    return LLM(
        model,
        block_size=BLOCK_SIZE,
        num_kv_blocks=32,
        max_num_batched_tokens=32,  # the prompt takes two chunks
        kv_transfer_config=kv_transfer_config,
    )


def run(llm: LLM, cache_salt: str | None = None):
    [output] = llm.generate(
        {"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False, cache_salt=cache_salt
    )
    return output.outputs[0].token_ids, output.num_cached_tokens


def stored_files(storage: Path) -> list[Path]:
    return sorted(storage.glob("*/*/*.kv"))


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    llm = make_llm(tiny_model_dirs["llama"], None)
    token_ids, cached = run(llm)
    assert cached == 0
    return token_ids


def restart(model: str, storage: Path, cache_salt: str | None = None):
    """A fresh engine on `storage` (the previous one is gone: nothing in its memory)."""
    gc.collect()
    llm = make_llm(model, storage)
    result = run(llm, cache_salt)
    stats = llm.llm_engine.engine_core.make_stats().kv_connector_stats
    return result, stats


def test_restart_serves_stored_blocks(tiny_model_dirs, reference, tmp_path):
    model = tiny_model_dirs["llama"]
    (token_ids, cached), stats = restart(model, tmp_path)
    assert (token_ids, cached) == (reference, 0)
    assert len(stored_files(tmp_path)) == 3  # the prompt's full blocks (output: no full block)
    assert stats.bytes_saved > 0 and stats.external_prefix_cache_hits == 0

    (token_ids, cached), stats = restart(model, tmp_path)
    assert token_ids == reference
    assert cached == 3 * BLOCK_SIZE
    assert stats.external_prefix_cache_hits == 3 * BLOCK_SIZE
    assert stats.external_prefix_cache_queries == len(PROMPT)
    header = 48  # magic, checksum, length (block_files.py)
    assert stats.bytes_loaded == sum(p.stat().st_size - header for p in stored_files(tmp_path))
    assert not list(tmp_path.glob(".pins/*/*")), "every pin is released after its load"


def test_corrupt_file_is_skipped_and_removed(tiny_model_dirs, reference, tmp_path):
    model = tiny_model_dirs["llama"]
    restart(model, tmp_path)
    files = stored_files(tmp_path)
    assert len(files) == 3
    # Files are written in prompt order: flip one byte of the second block's.
    by_age = sorted(files, key=lambda path: path.stat().st_mtime_ns)
    second = by_age[1]
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF
    second.write_bytes(bytes(data))

    (token_ids, cached), stats = restart(model, tmp_path)
    assert token_ids == reference
    assert cached == BLOCK_SIZE  # the first block; the corrupt second ends the match
    assert stats.corrupt_blocks == 1
    # Recomputed blocks are stored again, whole.
    assert len(stored_files(tmp_path)) == 3

    # A torn file (cut short) is skipped the same way.
    first = by_age[0]
    first.write_bytes(first.read_bytes()[:100])
    (token_ids, cached), stats = restart(model, tmp_path)
    assert (token_ids, cached) == (reference, 0)
    assert stats.corrupt_blocks == 1


def test_another_salt_sees_nothing(tiny_model_dirs, reference, tmp_path):
    model = tiny_model_dirs["llama"]
    restart(model, tmp_path, cache_salt="tenant-a")
    (token_ids, cached), _ = restart(model, tmp_path, cache_salt="tenant-b")
    assert (token_ids, cached) == (reference, 0)
    (token_ids, cached), _ = restart(model, tmp_path, cache_salt="tenant-a")
    assert (token_ids, cached) == (reference, 3 * BLOCK_SIZE)


def test_bad_config_is_a_value_error(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    bad = [
        {"kv_connector": "NoSuchConnector"},
        {"kv_connector": "SharedStorageConnector"},  # no shared_storage_path
        {"kv_connector": "SharedStorageConnector", "kv_role": "kv_sideways",
         "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}},
        {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config":
         {"shared_storage_path": str(tmp_path), "max_size_gb": -1}},
        json.dumps({"kv_connector": "SharedStorageConnector", "surprise": 1}),
    ]
    for config in bad:
        with pytest.raises(ValueError):
            LLM(model, block_size=BLOCK_SIZE, num_kv_blocks=32, kv_transfer_config=config)
