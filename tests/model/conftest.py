"""Fixtures the model tests share."""

from __future__ import annotations

import pytest

from tokenserve.model.fused_decode import FusedDecodeLayerStack


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """The rows of each step the fused path took."""
    calls: list[int] = []
    original = FusedDecodeLayerStack.__call__

    def counting(self, positions, hidden_states, kv_caches, metadata, residual=None):
        if residual is None and self.takes(hidden_states.shape[0], metadata):
            calls.append(hidden_states.shape[0])
        return original(self, positions, hidden_states, kv_caches, metadata, residual)

    monkeypatch.setattr(FusedDecodeLayerStack, "__call__", counting)
    return calls
