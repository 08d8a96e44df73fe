"""Fixtures the model tests share."""

from __future__ import annotations

import pytest

from tokenserve.model.fused_decode import FusedDecodeLayerStack
from tokenserve.model.layers.quantization.gguf import QuantizedWeight


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """The rows of each step the fused path took."""
    calls: list[int] = []
    original = FusedDecodeLayerStack.__call__

    def counting(self, positions, hidden_states, kv_caches, metadata, residual=None):
        if residual is None and self.takes(hidden_states.shape[0], metadata, kv_caches):
            calls.append(hidden_states.shape[0])
        return original(self, positions, hidden_states, kv_caches, metadata, residual)

    monkeypatch.setattr(FusedDecodeLayerStack, "__call__", counting)
    return calls


@pytest.fixture
def block_rows_where(monkeypatch):
    """`block_rows_where(predicate)`: the rows of every product on GGUF blocks whose weight
    satisfies predicate(weight), in a list that fills as the test runs."""

    def counter(predicate) -> list[int]:
        rows: list[int] = []
        original = QuantizedWeight.matmul

        def counting(self, x, panels=None):
            if predicate(self):
                rows.append(x.shape[0])
            return original(self, x, panels)

        monkeypatch.setattr(QuantizedWeight, "matmul", counting)
        return rows

    return counter
