"""The in-memory response store: bounded (least recently used goes first), per API key."""

from __future__ import annotations

import pytest

from tokenserve.entrypoints.openai.protocol import ChatMessage
from tokenserve.entrypoints.openai.response_store import ResponseStore, StoredResponse
from tokenserve.entrypoints.openai.responses_protocol import ResponseObject


def stored(response_id: str, owner: str | None = None) -> StoredResponse:
    response = ResponseObject(id=response_id, status="completed", model="m")
    return StoredResponse(response, [ChatMessage(role="user", content=response_id)], owner)


def test_the_least_recently_used_is_forgotten_past_the_bound():
    store = ResponseStore(max_responses=2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a", None) is not None  # "a" used: "b" is now the oldest
    store.put(stored("c"))
    assert len(store) == 2
    assert store.get("b", None) is None
    assert [store.get(i, None).messages[0].content for i in ("a", "c")] == ["a", "c"]


def test_a_response_belongs_to_its_key():
    store = ResponseStore()
    store.put(stored("a", owner="tenant-1"))
    assert store.get("a", "tenant-2") is None and store.get("a", None) is None
    assert not store.delete("a", "tenant-2")
    assert store.delete("a", "tenant-1") and store.get("a", "tenant-1") is None


def test_the_bound_must_hold_one():
    with pytest.raises(ValueError, match="at least 1"):
        ResponseStore(max_responses=0)
