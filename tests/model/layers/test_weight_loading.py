"""copy_rows inside a load: a parameter filled, row for row, by marked tensors lying one after
another in one storage becomes a view of them; every other parameter gets copies."""

from __future__ import annotations

import pytest
import torch

from tokenserve.model.layers.weight_loading import copies_submitted_to, copy_rows, mark_aliasable


def load(parts: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]]) -> list:
    """copy_rows of each (param, weight, rows) inside one load; the copies it submitted."""
    submitted = []

    def submit(copy, source):
        submitted.append(source)
        copy(source)

    with copies_submitted_to(submit):
        for param, weight, rows in parts:
            copy_rows(param, weight, rows)
    return submitted


def storage() -> torch.Tensor:
    """40 float32 of distinct values: a 10 x 4 parameter's worth."""
    return torch.arange(40, dtype=torch.float32)


def test_parts_side_by_side_in_one_storage_become_the_parameter():
    memory = storage()
    q = mark_aliasable(memory[0:24].view(6, 4))
    k = mark_aliasable(memory[24:32].view(2, 4))
    v = mark_aliasable(memory[32:40].view(2, 4))
    param = torch.nn.Parameter(torch.zeros(10, 4), requires_grad=False)
    # The loaders hand the parts in any order: rows decide.
    assert load([(param, v, (8, 2)), (param, q, (0, 6)), (param, k, (6, 2))]) == []
    assert param.data_ptr() == memory.data_ptr()
    assert torch.equal(param, memory.view(10, 4))
    whole = mark_aliasable(memory.view(10, 4))
    other = torch.nn.Parameter(torch.zeros(10, 4), requires_grad=False)
    assert load([(other, whole, None)]) == [] and other.data_ptr() == memory.data_ptr()


@pytest.mark.parametrize("case", ["storage order", "gap", "rows missing", "unmarked part",
                                  "another dtype", "two storages"])
def test_anything_else_is_copied(case: str):
    memory = torch.arange(48, dtype=torch.float32)
    first, second = memory[0:24].view(6, 4), memory[24:40].view(4, 4)
    if case == "storage order":  # the second rows lie before the first in memory
        first, second = memory[16:40].view(6, 4), memory[0:16].view(4, 4)
    elif case == "gap":  # a row's worth of memory between the parts
        second = memory[28:44].view(4, 4)
    elif case == "two storages":
        second = memory.clone()[24:40].view(4, 4)
    dtype = torch.bfloat16 if case == "another dtype" else torch.float32
    param = torch.nn.Parameter(torch.zeros(10, 4, dtype=dtype), requires_grad=False)
    parts = [(param, mark_aliasable(first), (0, 6))]
    if case != "rows missing":
        weight = second if case == "unmarked part" else mark_aliasable(second)
        parts.append((param, weight, (6, 4)))
    expected = torch.cat([first, second if case != "rows missing" else torch.zeros(4, 4)])
    submitted = load(parts)
    assert len(submitted) == len(parts)
    assert param.untyped_storage().data_ptr() != memory.untyped_storage().data_ptr()
    assert torch.equal(param, expected.to(dtype))


def test_outside_a_load_a_marked_weight_is_copied():
    memory = storage()
    param = torch.nn.Parameter(torch.zeros(10, 4), requires_grad=False)
    copy_rows(param, mark_aliasable(memory.view(10, 4)))
    assert param.data_ptr() != memory.data_ptr() and torch.equal(param, memory.view(10, 4))


def test_a_shape_that_does_not_fit_fails_at_once_inside_a_load():
    param = torch.nn.Parameter(torch.zeros(10, 4), requires_grad=False)
    with pytest.raises(ValueError, match="does not fit"):
        load([(param, mark_aliasable(storage().view(8, 5)), None)])
