"""Waiting queues (first come first served, or by priority) and the order prompts are
granted a step's tokens in."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from tokenserve.core.request import Request, RequestStatus


class RequestQueue:
    """The waiting requests, in the order the scheduler should admit them."""

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def prepend(self, request: Request) -> None:
        """Put back a preempted request so that it is admitted before newer ones."""
        raise NotImplementedError

    def peek(self) -> Request:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        """Take out a request wherever it is (the scheduler admits from near the head)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)  # scans from the head: cheap near it

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    """Lowest (priority, arrival_time) first; ties broken by insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*request.sort_key(), next(self._counter), request))

    def prepend(self, request: Request) -> None:
        # Priority order already puts a preempted request where it belongs.
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        if self._heap and self._heap[0][-1] is request:
            heapq.heappop(self._heap)
            return
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        # Lazily, in order: reading only the head costs a copy, not a sort.
        heap = list(self._heap)
        while heap:
            yield heapq.heappop(heap)[-1]


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}.")


def remaining_prompt_tokens(request: Request) -> int:
    """Prompt tokens the request has yet to compute; past its prompt (recomputing its
    output after a preemption), none."""
    return max(request.num_prompt_tokens - request.num_computed_tokens, 0)


def order_for_prefill(
    running: list[Request], waiting: list[Request], shortest_first: bool
) -> list[Request]:
    """The order in which prompt chunks get a step's tokens (after its decode rows).

    By arrival: `running` (prompts already started, in admission order), then `waiting`
    (in queue order). Shortest first: running prompts and fresh waiting requests by fewest
    remaining prompt tokens, ties by arrival time and then that same order; so a short
    request does not wait for a long prompt to finish, and prompts of one length keep
    first come first served. Preempted waiting requests go in queue order right after
    the last running prompt: ahead of the fresh prompts after it, as first come first
    served puts them, but never ahead of a running prompt (the request gave way to the
    running ones; going first again, it could be preempted again and again while they
    never advance).
    """
    if not shortest_first:
        return running + waiting
    resuming = [r for r in waiting if r.status == RequestStatus.PREEMPTED]
    fresh = [r for r in waiting if r.status != RequestStatus.PREEMPTED]
    ranked = sorted(running + fresh, key=lambda r: (remaining_prompt_tokens(r), r.arrival_time))
    started = set(running)
    after_running = max((i + 1 for i, r in enumerate(ranked) if r in started), default=0)
    return ranked[:after_running] + resuming + ranked[after_running:]
