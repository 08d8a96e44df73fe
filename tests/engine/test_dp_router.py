"""The data-parallel router: least loaded, prefix affinity, fallback; and the CPU split."""

from __future__ import annotations

import pytest

from tokenserve.config import ParallelConfig
from tokenserve.engine.dp_client import split_cpus
from tokenserve.engine.dp_router import DataParallelRouter

BLOCK = 4


def prompt(prefix_seed: int, num_prefix_blocks: int, tail: int) -> list[int]:
    """A prompt of `num_prefix_blocks` full blocks fixed by `prefix_seed`, then a unique tail."""
    prefix = [prefix_seed * 1000 + position for position in range(num_prefix_blocks * BLOCK)]
    return prefix + [tail, tail + 1]


def test_least_loaded_and_turns_among_equal_loads():
    router = DataParallelRouter(3, BLOCK)
    # Idle engines take turns; short prompts (no full block) carry no affinity.
    assert [router.route(f"r{i}", [i]) for i in range(3)] == [0, 1, 2]
    router.finish("r1")
    assert router.loads == [1, 0, 1]
    assert router.route("r3", [3]) == 1
    router.finish("r0")
    router.finish("r2")
    assert router.route("r4", [4]) in (0, 2)
    assert router.loads.count(1) == 2 and sum(router.loads) == 2


def test_requests_sharing_a_prefix_meet_on_its_engine():
    router = DataParallelRouter(2, BLOCK)
    first = router.route("a", prompt(1, 3, tail=1))
    router.finish("a")
    # Without affinity the turn would pass to the other engine.
    assert router.least_loaded() != first
    assert router.route("b", prompt(1, 3, tail=2)) == first
    # A different prefix goes to the least loaded engine.
    assert router.route("c", prompt(2, 3, tail=1)) != first
    # Sharing only the first block still meets the first prompt's engine.
    shared_first_block = prompt(1, 1, tail=0) + prompt(3, 2, tail=9)
    assert router.route("d", shared_first_block) == first


@pytest.mark.parametrize(
    "other", [{"cache_salt": "tenant-b"}, {"cache_salt": "tenant-a", "lora_name": "sql"}]
)
def test_salt_and_adapter_keep_prefixes_apart(other):
    router = DataParallelRouter(2, BLOCK)
    tokens = prompt(1, 2, tail=1)
    first = router.route("a", tokens, cache_salt="tenant-a")
    router.finish("a")
    # Same tokens, other KV: no affinity, so the turn passes to the other engine.
    assert router.route("b", tokens, **other) != first
    router.finish("b")
    assert router.route("c", tokens, cache_salt="tenant-a") == first


def test_affinity_gives_way_to_a_much_less_loaded_engine():
    router = DataParallelRouter(2, BLOCK, imbalance_ratio=2.0, imbalance_slack=2)
    tokens = prompt(1, 2, tail=1)
    engines = [router.route(f"r{i}", tokens) for i in range(4)]
    # Loads 1, 2, 3 on the prefix's engine stay within 2 * 0 + 2 until the third is there.
    assert engines[:3] == [engines[0]] * 3
    assert engines[3] != engines[0]
    # Now both engines hold the prefix: the less loaded of them gets the next ones.
    assert router.route("r4", tokens) == engines[3]
    assert router.loads == [3, 2] or router.loads == [2, 3]


def test_finish_and_aborts_release_load_once():
    router = DataParallelRouter(2, BLOCK)
    engine = router.route("a", [1, 2, 3])
    assert router.engine_of("a") == engine
    assert router.finish("a") == engine
    assert router.finish("a") is None
    assert router.loads == [0, 0]
    router.route("b", [1])
    with pytest.raises(ValueError, match="already routed"):
        router.route("b", [1])


def test_prefix_table_is_bounded():
    router = DataParallelRouter(2, BLOCK, max_prefix_blocks=2, table_size=5)
    for index in range(10):
        router.route(f"r{index}", prompt(index, 4, tail=0))
    assert len(router.prefix_holders) == 5


def test_cpus_are_split_into_distinct_sets():
    assert split_cpus(2, [0, 1]) == [[0], [1]]
    assert split_cpus(1, [1, 0]) == [[0, 1]]
    assert split_cpus(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="data_parallel_size 3 needs at least 3 CPU cores"):
        split_cpus(3, [0, 1])


@pytest.mark.parametrize("argv", [["-dp", "2"], ["--data-parallel-size", "2"]])
def test_data_parallel_size_flag_reaches_the_parallel_config(tiny_model_dirs, argv):
    from tokenserve.engine.cli_args import engine_args_from
    from tokenserve.entrypoints.cli import build_parser

    namespace = build_parser().parse_args(["serve", tiny_model_dirs["llama"], *argv])
    config = engine_args_from(namespace).create_engine_config()
    assert config.parallel_config.data_parallel_size == 2


@pytest.mark.parametrize("size", [0, -1, True, 1.5])
def test_bad_data_parallel_sizes_are_refused(size):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        ParallelConfig(data_parallel_size=size)
