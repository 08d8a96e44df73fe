"""An idle engine core packs the weights its load left unpacked (a layer per call), then builds
its bf16 products' oneDNN primitives ahead of the steps that run them
(worker/product_warm_up.py): each distinct weight shape once per row bucket up to the step
budget's, the most rows first, one product per call; then the heap a full step takes and the
weights' huge pages (worker/cpu_memory.py), before the KV cache's pages."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch

from tests.core.greedy import greedy_tokens
from tokenserve import SamplingParams
from tokenserve.core.engine_core import EngineCore
from tokenserve.core.engine_core_proc import PREFAULT_SLICE_SECONDS, EngineCoreProc
from tokenserve.core.request import Request
from tokenserve.engine.engine_args import EngineArgs
from tokenserve.engine.llm_engine import LLMEngine
from tokenserve.model.layers.linear import ReplicatedLinear
from tokenserve.model.layers.quantization.unquantized import UnquantizedLinearMethod
from tokenserve.model.registry import layers_to_pack
from tokenserve.kernels.row_buckets import buckets_up_to
from tokenserve.worker.product_warm_up import MAX_PRODUCTS, ProductWarmUp, warm_up_plan


def _core(model_dir: str) -> EngineCore:
    return EngineCore(
        EngineArgs(model=model_dir, dtype="bfloat16", kv_cache_memory="8MiB",
                   max_num_batched_tokens=100, max_model_len=100).create_engine_config()
    )


def _model(core: EngineCore):
    [model] = core.collective_rpc(lambda worker: worker.model_runner.model)
    return model


def _packed(in_features: int, out_features: int) -> ReplicatedLinear:
    layer = ReplicatedLinear(in_features, out_features, bias=False,
                             quant_method=UnquantizedLinearMethod(weight_dtype=torch.bfloat16))
    layer.weight.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _shape(layer) -> tuple[int, int]:
    return layer.input_size_per_partition, layer.output_size_per_partition


def test_an_idle_engine_core_builds_each_product_once_per_bucket(tiny_model_dirs):
    core = _core(tiny_model_dirs["llama"])
    model = _model(core)
    # The load left oneDNN's packing to the idle time: a layer per call comes first.
    pending = len(layers_to_pack(model))
    assert pending > 0
    assert all(core.warm_up() for _ in range(pending)) and not layers_to_pack(model)
    plan = warm_up_plan(model, 100)
    if not plan:
        pytest.skip("torch's oneDNN did not pack the bf16 weights here")
    shapes = {_shape(layer) for layer, _ in plan}
    # q/k/v, o, gate/up and down: each shape at every bucket, the budget's (112) first,
    # then down from there.
    assert len(shapes) == 4
    buckets = (112, 96, 80, 64, 48, 32, 16)
    assert [rows for _, rows in plan] == [rows for rows in buckets for _ in shapes]
    assert all({_shape(layer) for layer, r in plan if r == rows} == shapes for rows in buckets)
    calls = 0
    while core.warm_up():
        calls += 1
    # A call per product, then one per piece of the heap a full step takes, then one per
    # huge page of the weights (tests/worker/test_weight_huge_pages.py) that the kernel was
    # asked to move (the call of the last piece says none is left; with no page to move, a
    # call after the heap's last piece does nothing and says so).
    [(heap, pages)] = core.collective_rpc(
        lambda worker: (worker.model_runner.heap_reserve, worker.model_runner.weight_pages))
    assert heap is not None and heap.done == heap.pieces
    assert pages is not None and pages.done == len(pages.pages)
    asked = pages.moved + sum(pages.refusals.values())
    assert calls == len(plan) + heap.pieces + max(asked - 1, 0)
    assert not core.warm_up()
    # The products' weights untouched: the same tokens as an engine that did not warm up.
    assert greedy_tokens(core) == greedy_tokens(_core(tiny_model_dirs["llama"]))
    core.add_request(Request("s", [5, 6], SamplingParams(max_tokens=2), eos_token_id=None))
    with pytest.raises(AssertionError, match="only while idle"):
        core.warm_up()


def test_an_offline_engine_packs_its_weights_before_its_first_step(tiny_model_dirs):
    # No idle loop offline (LLM): the engine is built packed, as the server's is once idle.
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_model_dirs["llama"], kv_cache_memory="8MiB", max_model_len=100))
    [(model, left)] = engine.engine_core.collective_rpc(
        lambda worker: (worker.model_runner.model, worker.model_runner.layers_to_pack))
    assert not layers_to_pack(model) and left == []
    assert any(getattr(module, "packed_weight", None) is not None for module in model.modules())


def test_the_plan_leaves_out_rows_other_kernels_take():
    small, large = _packed(64, 32), _packed(32, 64)
    if small.packed_weight is None:
        pytest.skip("torch's oneDNN did not pack the bf16 weights here")
    # As a GGUF layer's blocks take products of up to 32 rows: those read float32.
    small.input_dtype = lambda rows: None if rows <= 32 else torch.bfloat16
    model = torch.nn.ModuleList([small, large, _packed(64, 32)])  # a shape seen twice
    plan = [(layer is small, rows) for layer, rows in warm_up_plan(model, 60)]
    # Budget 60: its bucket (64) first, then 48, 32, 16; `small` from 48 rows on.
    assert plan == [(True, 64), (False, 64), (True, 48), (False, 48), (False, 32), (False, 16)]
    warm_up = ProductWarmUp(model, 60)
    assert [warm_up.step() for _ in range(len(plan) + 1)] == [True] * len(plan) + [False]
    # A GGUF layer whose blocks' AMX kernel takes up to 32 rows: it reads bf16 there too,
    # but builds no oneDNN primitive, so those rows are left out as well.
    amx = _packed(48, 16)
    amx.blocks = SimpleNamespace(takes=lambda rows: rows <= 32)
    amx.input_dtype = lambda rows: torch.bfloat16
    assert [rows for _, rows in warm_up_plan(torch.nn.ModuleList([amx]), 60)] == [64, 48]
    # Above 1,024 rows the buckets are coarser: a budget of 9,600 rows has 115 of them
    # (up to 9,728). Five shapes at each would be 575 products: MAX_PRODUCTS are kept, the
    # budget's bucket and the smallest, run from the most rows down.
    buckets = buckets_up_to(9600)
    assert len(buckets) == 115 and buckets[-1] == 9728
    shapes = torch.nn.ModuleList([_packed(32, 16 * (i + 1)) for i in range(5)])
    plan = warm_up_plan(shapes, 9600)
    assert len(plan) == MAX_PRODUCTS
    # The budget's bucket, then buckets from 16 rows up: 101 whole and 2 of the 102nd's 5.
    kept = [9728] * 5 + [rows for rows in buckets[:101] for _ in range(5)] + [buckets[101]] * 2
    assert [rows for _, rows in plan] == sorted(kept, reverse=True)


class _IdleCore:
    """The engine core as the idle loop sees it: products to build, then pages."""

    def __init__(self, inputs: queue.Queue, products: int, slices: int, input_after: int):
        self.inputs, self.products, self.slices = inputs, products, slices
        self.input_after = input_after
        self.calls: list[str] = []

    def _called(self, what: str) -> None:
        self.calls.append(what)
        if len(self.calls) == self.input_after:
            self.inputs.put(("ADD", "request"))  # arrives while this piece is done

    def warm_up(self) -> bool:
        self._called("product")
        self.products -= 1
        return self.products > 0

    def prefault_kv_cache(self, max_seconds: float) -> bool:
        assert max_seconds == PREFAULT_SLICE_SECONDS
        self._called("slice")
        self.slices -= 1
        return self.slices > 0


def test_the_idle_loop_builds_the_products_before_faulting_pages_in():
    proc = EngineCoreProc.__new__(EngineCoreProc)  # no sockets: the loop's own state only
    proc.input_queue = queue.Queue()
    proc.warming = proc.prefaulting = True
    core = proc.engine_core = _IdleCore(proc.input_queue, products=3, slices=2, input_after=2)
    assert proc._next_input_while_idle() == ("ADD", "request")
    assert core.calls == ["product", "product"] and proc.warming  # the input after a piece
    core.input_after = 5
    assert proc._next_input_while_idle() == ("ADD", "request")
    assert core.calls == ["product"] * 3 + ["slice"] * 2
    assert not proc.warming and not proc.prefaulting
