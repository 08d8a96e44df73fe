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
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tokenserve import kernels
from tokenserve.attention.backend import AttentionBackend, AttentionMetadata


def _context_slots(block_table: list[int], seq_len: int, block_size: int) -> np.ndarray:
    positions = np.arange(seq_len)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + (
        positions % block_size
    )


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(self, use_kernels: bool = True) -> None:
        self.ops = kernels.paged_attention() if use_kernels else None

    def prepare(self, metadata: AttentionMetadata, device: torch.device) -> None:
        decode_rows: list[int] = []
        decode_reqs: list[int] = []
        prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
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
            slots = torch.from_numpy(
                _context_slots(metadata.block_tables[i], seq_len, metadata.block_size)
            ).to(device)
            # Query j sits at position seq_len - query_len + j and sees keys up to it.
            query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
            prefills.append((start, end, slots, mask))

        data: dict = {"prefills": prefills, "decode_rows": None}
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
                # Pad every context to max_len with slot 0; the mask hides the padding.
                slot_matrix = np.zeros((len(decode_reqs), max_len), dtype=np.int64)
                for row, i in enumerate(decode_reqs):
                    slot_matrix[row, : seq_lens[row]] = _context_slots(
                        metadata.block_tables[i], seq_lens[row], metadata.block_size
                    )
                lengths = torch.tensor(seq_lens, device=device)
                data["decode_slots"] = torch.from_numpy(slot_matrix).to(device)
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
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
        flat_values = value_cache.view(-1, num_kv_heads, head_dim)
        if self.ops is not None:
            self.ops.write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        else:
            flat_keys.index_copy_(0, metadata.slot_mapping, key)
            flat_values.index_copy_(0, metadata.slot_mapping, value)

        data = metadata.backend_data
        output = torch.empty_like(query)
        for start, end, slots, mask in data["prefills"]:
            if slots is None:
                k, v = key[start:end], value[start:end]
            else:
                k, v = flat_keys[slots], flat_values[slots]
            # [1, heads, tokens, head_dim]: the 4-D form is what PyTorch's CPU flash kernel takes.
            out = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
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
        slots = data["decode_slots"]
        q = query[rows].unsqueeze(2)  # [batch, heads, 1, head_dim]
        k = flat_keys[slots].transpose(1, 2)  # [batch, kv_heads, max_len, head_dim]
        v = flat_values[slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=data["decode_mask"], scale=scale, enable_gqa=True
        )
        output[rows] = out.squeeze(2)
        return output
