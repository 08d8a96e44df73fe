"""Row buckets of bf16 products (kernels/row_buckets.py): a bf16 product reads its rows
padded to a bucket, in place where its input's storage has room (no copy), by a copy with
zero rows where not; what the padding rows hold never reaches a real row's result; and the
operators that feed bf16 products leave that room."""

from __future__ import annotations

import pytest
import torch

from tokenserve.kernels import layer_ops
from tokenserve.kernels.row_buckets import (
    FINE_ROWS,
    ROW_BUCKET,
    bucket_rows,
    bucketed,
    buckets_up_to,
    empty_rows,
)
from tokenserve.model.layers.linear import ReplicatedLinear
from tokenserve.model.layers.quantization import UnquantizedLinearMethod


def test_bucket_rows_rounds_up_to_the_bucket():
    assert [bucket_rows(r) for r in (1, ROW_BUCKET, ROW_BUCKET + 1)] == [
        ROW_BUCKET, ROW_BUCKET, 2 * ROW_BUCKET]
    # Multiples of ROW_BUCKET up to FINE_ROWS (1,024), then of a sixteenth of the power of
    # two below the rows: 64 up to 2,048, 128 up to 4,096, ...
    assert FINE_ROWS == 1024
    assert [bucket_rows(r) for r in (1023, 1024, 1025, 1088, 1089, 2047, 2048, 2049, 4097)] == [
        1024, 1024, 1088, 1088, 1152, 2048, 2048, 2176, 4352]


def test_buckets_pad_little_and_stay_few():
    buckets = buckets_up_to(8192)
    assert buckets == sorted(set(buckets)) and buckets[0] == ROW_BUCKET
    assert buckets[:64] == list(range(ROW_BUCKET, FINE_ROWS + 1, ROW_BUCKET))
    assert len(buckets) == 64 + 3 * 16 and buckets[-1] == 8192  # 16 more per doubling
    for rows in range(1, 8193):
        bucket = bucket_rows(rows)
        assert bucket in buckets and bucket_rows(bucket) == bucket
        # Never more than ROW_BUCKET - 1 padding rows, or under 1/16 of the rows above.
        assert bucket - rows < max(ROW_BUCKET, rows / 16)
    assert buckets_up_to(1) == [ROW_BUCKET] and buckets_up_to(1030) == [*buckets[:64], 1088]


def test_empty_rows_is_made_on_the_device_asked_for():
    # The meta device has storage sizes but no memory: enough to check where and how big.
    x = empty_rows((ROW_BUCKET + 1, 8), torch.bfloat16, torch.device("meta"))
    assert x.device.type == "meta" and x.shape == (ROW_BUCKET + 1, 8)
    assert x.untyped_storage().nbytes() == 2 * ROW_BUCKET * 8 * 2


def test_empty_rows_storage_holds_the_bucket_and_bucketed_reads_it_in_place():
    x = empty_rows((ROW_BUCKET + 3, 8), torch.bfloat16)
    assert x.shape == (ROW_BUCKET + 3, 8) and x.is_contiguous()
    padded = bucketed(x)
    assert padded.shape == (2 * ROW_BUCKET, 8)
    assert padded.data_ptr() == x.data_ptr()  # a view: nothing copied
    x.fill_(3)
    assert torch.equal(padded[: x.shape[0]], x)


def test_bucketed_copies_with_zero_rows_where_the_storage_has_no_room():
    x = torch.randn(ROW_BUCKET + 3, 8).bfloat16()  # storage of exactly its rows
    padded = bucketed(x)
    assert padded.shape == (2 * ROW_BUCKET, 8) and padded.data_ptr() != x.data_ptr()
    assert torch.equal(padded[: x.shape[0]], x) and not padded[x.shape[0]:].any()
    # A strided view (every other row) is copied too, even with room after it.
    strided = empty_rows((2 * ROW_BUCKET + 6, 8), torch.bfloat16)[::2]
    assert bucketed(strided).data_ptr() != strided.data_ptr()
    # Whole buckets are returned as they are.
    whole = torch.randn(ROW_BUCKET, 8).bfloat16()
    assert bucketed(whole) is whole


@pytest.mark.parametrize("rows", [1, ROW_BUCKET - 1, ROW_BUCKET + 2, 3 * ROW_BUCKET + 5,
                                  FINE_ROWS + 5])
@pytest.mark.parametrize("use_onednn", [True, False])
def test_padding_rows_never_reach_the_result(rows, use_onednn):
    # Non-finite padding (what an uninitialised or reused buffer may hold) must not change a
    # real row's result: it equals the same product on an input without room (zero padding).
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 64, generator=generator)
    method = UnquantizedLinearMethod(use_onednn=use_onednn, weight_dtype=torch.bfloat16)
    layer = ReplicatedLinear(64, 48, quant_method=method)
    layer.weight.weight_loader(layer.weight, weight)
    method.process_weights_after_loading(layer)
    x = torch.randn(rows, 64, generator=generator).bfloat16()
    roomy = empty_rows((rows, 64), torch.bfloat16)
    roomy.as_strided((bucket_rows(rows), 64), (64, 1)).fill_(float("nan"))
    roomy.copy_(x)
    out = layer(roomy)
    assert out.shape == (rows, 48) and torch.isfinite(out).all()
    assert torch.equal(out, layer(x.clone()))


def test_layer_ops_bf16_results_leave_room_for_the_bucket():
    ops = layer_ops.load()
    assert ops is not None, "the C kernels did not build (see the warning in the log)"
    rows = ROW_BUCKET + 1
    normed = ops.rms_norm(torch.randn(rows, 64), torch.ones(64), 1e-6, None, torch.bfloat16)
    activated = ops.silu_and_mul(torch.randn(rows, 128), torch.bfloat16)
    for result in (normed, activated):
        assert bucketed(result).data_ptr() == result.data_ptr()
