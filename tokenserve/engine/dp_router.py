"""Which engine core a request goes to under data parallelism.

Each request goes to the least loaded engine (its unfinished requests, counted in the API
process, so without lag), unless an engine already holds the request's prefix: requests
that share full blocks of prompt tokens (with the same cache salt and LoRA adapter) meet
on the engine that cached them, so that its prefix cache serves them. A bounded table
remembers, for the chained hash of each of a prompt's first blocks, which engines were
sent it lately. Affinity gives way when the engine holding the prefix is much more loaded
than the least loaded one; the prefix is then cached on that one too. Equal loads take
turns, so that an idle server spreads its requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Prefix blocks hashed per request: enough to tell long shared prefixes apart, bounded cost.
DEFAULT_MAX_PREFIX_BLOCKS = 16
# Prefix hashes remembered (least recently used forgotten first).
DEFAULT_TABLE_SIZE = 8192
# Affinity holds while the prefix's engine has at most this many times the least loaded
# engine's requests, plus the slack below; beyond it the request goes to the least loaded.
DEFAULT_IMBALANCE_RATIO = 2.0
DEFAULT_IMBALANCE_SLACK = 4


class DataParallelRouter:
    def __init__(
        self,
        num_engines: int,
        block_size: int,
        max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
        table_size: int = DEFAULT_TABLE_SIZE,
        imbalance_ratio: float = DEFAULT_IMBALANCE_RATIO,
        imbalance_slack: int = DEFAULT_IMBALANCE_SLACK,
    ) -> None:
        if num_engines < 1 or block_size < 1:
            raise ValueError("A router needs at least one engine and a positive block size.")
        self.num_engines = num_engines
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.table_size = table_size
        self.imbalance_ratio = imbalance_ratio
        self.imbalance_slack = imbalance_slack
        # Unfinished requests per engine, and which engine each one is on.
        self.loads = [0] * num_engines
        self.owners: dict[str, int] = {}
        # Chained prefix hash → the engines it was sent to lately.
        self.prefix_holders: OrderedDict[int, set[int]] = OrderedDict()
        self._next_engine = 0  # where the turn-taking among equal loads starts

    def route(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> int:
        """The engine for a new request; it counts there until `finish(request_id)`."""
        if request_id in self.owners:
            raise ValueError(f"Request id {request_id!r} is already routed.")
        least = self.least_loaded()
        keys = self.prefix_keys(prompt_token_ids, cache_salt, lora_name)
        engine = least
        holders = self._longest_held_prefix(keys)
        if holders:
            candidate = min(holders, key=lambda index: (self.loads[index], index))
            if not self._much_more_loaded(candidate, least):
                engine = candidate
        if engine == least:
            self._next_engine = (least + 1) % self.num_engines
        self._remember(keys, engine)
        self.loads[engine] += 1
        self.owners[request_id] = engine
        return engine

    def finish(self, request_id: str) -> int | None:
        """Forget a finished or aborted request; returns the engine it was on (None: unknown)."""
        engine = self.owners.pop(request_id, None)
        if engine is not None:
            self.loads[engine] -= 1
        return engine

    def engine_of(self, request_id: str) -> int | None:
        return self.owners.get(request_id)

    def least_loaded(self) -> int:
        """The engine with the fewest unfinished requests; ties go round, from the last pick on."""
        order = [(self._next_engine + offset) % self.num_engines for offset in range(self.num_engines)]
        return min(order, key=lambda index: self.loads[index])

    def prefix_keys(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None, lora_name: str | None
    ) -> list[int]:
        """Chained hashes of the prompt's first full blocks (the salt and adapter in the first),
        as the engine's block hashes chain: equal keys ⇒ the engine could share the blocks."""
        num_blocks = min(len(prompt_token_ids) // self.block_size, self.max_prefix_blocks)
        parent = hash((cache_salt, lora_name))
        keys = []
        for index in range(num_blocks):
            start = index * self.block_size
            parent = hash((parent, tuple(prompt_token_ids[start : start + self.block_size])))
            keys.append(parent)
        return keys

    def _longest_held_prefix(self, keys: list[int]) -> set[int]:
        for key in reversed(keys):
            holders = self.prefix_holders.get(key)
            if holders:
                return holders
        return set()

    def _much_more_loaded(self, engine: int, least: int) -> bool:
        limit = self.imbalance_ratio * self.loads[least] + self.imbalance_slack
        return self.loads[engine] > limit

    def _remember(self, keys: list[int], engine: int) -> None:
        for key in keys:
            self.prefix_holders.setdefault(key, set()).add(engine)
            self.prefix_holders.move_to_end(key)
        while len(self.prefix_holders) > self.table_size:
            self.prefix_holders.popitem(last=False)
