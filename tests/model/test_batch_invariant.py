"""--batch-invariant is refused where it cannot hold: outside a GGUF model in bfloat16 on the
amx level (tests/model/test_bf16_amx.py checks it where it does)."""

from __future__ import annotations

import pytest

from tokenserve import LLM


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_is_refused_for_a_dense_model(tiny_model_dirs, dtype):
    # A safetensors model's products all run on oneDNN (or F.linear), whose sums depend on
    # the row count.
    with pytest.raises(ValueError, match="batch_invariant needs a GGUF model in bfloat16 on "
                                         "the amx level"):
        LLM(tiny_model_dirs["llama"], dtype=dtype, kv_cache_memory="8MiB",
            max_num_batched_tokens=256, batch_invariant=True)


def test_batch_invariant_is_refused_for_a_float32_gguf_model():
    with pytest.raises(ValueError, match="this is a gguf model in torch.float32"):
        LLM(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=256,
            batch_invariant=True)
