"""Paged attention on CPU: PyTorch's scaled_dot_product_attention for prefill, a C kernel
for decode.

Each prefill chunk gets its own SDPA call (4-D, so PyTorch takes its flash kernel, GQA
included). A chunk with nothing cached before it attends over its own new keys and values
directly; a chunk that continues a context gathers that context once per layer and uses a
causal mask offset by the tokens already cached.

Decode rows (one query token) of all requests go to the paged-decode C kernel
(kernels.paged_attention), which reads each query in place from the fused QKV tensor and
each context in place from its blocks, and writes its rows of the output; a second
kernel writes the step's new keys and values into their slots. Where the kernels cannot
be built, decode rows are attended in one padded SDPA call over gathered contexts
instead (the same results, more memory traffic). Index tensors are built once per step,
in `prepare`.

Each layer's cache is K and V apart, [num_blocks, num_kv_heads, block_size, head_dim]: a
kv head's keys within a block are contiguous, which is what the decode kernel streams. A
token's slot is block * block_size + offset; a gather indexes [blocks, :, offsets]. The
cache may hold a narrower dtype than the model (--kv-cache-dtype bfloat16): keys and values
are rounded as they are written and widened as they are read. A first chunk attends to its
keys and values as computed; a chunk that continues a context reads all of it from the
cache, its own new tokens included.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tokenserve import kernels
from tokenserve.attention.backend import AttentionBackend, AttentionMetadata


def _context_index(
    block_table: list[int], seq_len: int, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Where a context's tokens lie in the cache: block ids and offsets in them."""
    positions = np.arange(seq_len)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size], positions % block_size


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A context's first seq_len tokens as [kv_heads, seq_len, head_dim]: whole blocks
    copied (twice as fast as gathering token by token), their heads then put first."""
    _, num_kv_heads, _, head_dim = cache.shape
    gathered = cache.index_select(0, blocks).transpose(0, 1)
    return gathered.reshape(num_kv_heads, -1, head_dim)[:, :seq_len]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(self, use_kernels: bool = True) -> None:
        self.ops = kernels.paged_attention() if use_kernels else None

    def prepare(self, metadata: AttentionMetadata, device: torch.device) -> None:
        decode_rows: list[int] = []
        decode_reqs: list[int] = []
        # (first row, end row, the context's (blocks, length) if it continues one, mask)
        prefills: list[tuple[int, int, tuple[torch.Tensor, int] | None, torch.Tensor | None]] = []
        for i in range(metadata.num_reqs):
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            if end - start == 1:
                decode_rows.append(start)
                decode_reqs.append(i)
                continue
            seq_len = metadata.seq_lens[i]
            query_len = end - start
            if seq_len == query_len:
                # Nothing cached before this chunk: its own keys are the whole context.
                prefills.append((start, end, None, None))
                continue
            num_blocks = -(-seq_len // metadata.block_size)
            blocks = torch.tensor(metadata.block_tables[i][:num_blocks], device=device)
            # Query j sits at position seq_len - query_len + j and sees keys up to it.
            query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
            prefills.append((start, end, (blocks, seq_len), mask))

        data: dict = {"prefills": prefills, "decode_rows": None}
        if self.ops is None:
            slots = metadata.slot_mapping
            data["write_index"] = (slots // metadata.block_size, slots % metadata.block_size)
        if decode_rows:
            seq_lens = [metadata.seq_lens[i] for i in decode_reqs]
            data["decode_rows"] = torch.tensor(decode_rows, device=device)
            if self.ops is not None:
                num_blocks = max(-(-n // metadata.block_size) for n in seq_lens)
                tables = np.zeros((len(decode_reqs), num_blocks), dtype=np.int64)
                for row, i in enumerate(decode_reqs):
                    used = -(-seq_lens[row] // metadata.block_size)
                    tables[row, :used] = metadata.block_tables[i][:used]
                data["decode_block_tables"] = torch.from_numpy(tables).to(device)
                data["decode_seq_lens"] = torch.tensor(seq_lens, dtype=torch.int64, device=device)
            else:
                max_len = max(seq_lens)
                # Pad every context to max_len with block 0's first slot; the mask hides the
                # padding.
                blocks = np.zeros((len(decode_reqs), max_len), dtype=np.int64)
                offsets = np.zeros((len(decode_reqs), max_len), dtype=np.int64)
                for row, i in enumerate(decode_reqs):
                    blocks[row, : seq_lens[row]], offsets[row, : seq_lens[row]] = _context_index(
                        metadata.block_tables[i], seq_lens[row], metadata.block_size
                    )
                lengths = torch.tensor(seq_lens, device=device)
                data["decode_context"] = (
                    torch.from_numpy(blocks).to(device),
                    torch.from_numpy(offsets).to(device),
                )
                data["decode_mask"] = (
                    torch.arange(max_len, device=device)[None, :] < lengths[:, None]
                )[:, None, None, :]
        metadata.backend_data = data

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        data = metadata.backend_data
        if self.ops is not None:
            self.ops.write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        else:
            blocks, offsets = data["write_index"]
            key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
            value_cache[blocks, :, offsets] = value.to(value_cache.dtype)

        output = torch.empty_like(query)
        for start, end, context, mask in data["prefills"]:
            if context is None:
                k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
            else:
                k = _gather_context(key_cache, *context).to(query.dtype)
                v = _gather_context(value_cache, *context).to(query.dtype)
            # [1, heads, tokens, head_dim]: the 4-D form is what PyTorch's CPU flash kernel takes.
            out = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1).unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            output[start:end] = out[0].transpose(0, 1)

        rows = data["decode_rows"]
        if rows is None:
            return output
        if self.ops is not None:
            self.ops.decode(
                output,
                query,
                rows,
                key_cache,
                value_cache,
                data["decode_block_tables"],
                data["decode_seq_lens"],
                scale,
            )
            return output
        blocks, offsets = data["decode_context"]
        q = query[rows].unsqueeze(2)  # [batch, heads, 1, head_dim]
        # [batch, kv_heads, max_len, head_dim]
        k = key_cache[blocks, :, offsets].transpose(1, 2).to(query.dtype)
        v = value_cache[blocks, :, offsets].transpose(1, 2).to(query.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=data["decode_mask"], scale=scale, enable_gqa=True
        )
        output[rows] = out.squeeze(2)
        return output
