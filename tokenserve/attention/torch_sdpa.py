"""Paged attention with PyTorch's scaled_dot_product_attention (the CPU backend).

Decode rows (one query token) of all requests are attended in one padded SDPA call;
each prefill chunk gets its own call with a causal mask offset by the tokens already
in the cache. The gather indices into the flat cache are built once per step.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tokenserve.attention.backend import AttentionBackend, AttentionMetadata


def _context_slots(block_table: list[int], seq_len: int, block_size: int) -> np.ndarray:
    positions = np.arange(seq_len)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + (
        positions % block_size
    )


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def prepare(self, metadata: AttentionMetadata, device: torch.device) -> None:
        decode_rows: list[int] = []
        decode_reqs: list[int] = []
        prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        for i in range(metadata.num_reqs):
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            if end - start == 1:
                decode_rows.append(start)
                decode_reqs.append(i)
                continue
            seq_len = metadata.seq_lens[i]
            slots = torch.from_numpy(
                _context_slots(metadata.block_tables[i], seq_len, metadata.block_size)
            ).to(device)
            query_len = end - start
            mask = None
            if seq_len > query_len:
                # Query j sits at position seq_len - query_len + j and sees keys up to it.
                query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
            prefills.append((start, end, slots, mask))

        data: dict = {"prefills": prefills, "decode_rows": None}
        if decode_rows:
            seq_lens = [metadata.seq_lens[i] for i in decode_reqs]
            max_len = max(seq_lens)
            # Pad every context to max_len with slot 0; the mask hides the padding.
            slot_matrix = np.zeros((len(decode_reqs), max_len), dtype=np.int64)
            for row, i in enumerate(decode_reqs):
                slot_matrix[row, : seq_lens[row]] = _context_slots(
                    metadata.block_tables[i], seq_lens[row], metadata.block_size
                )
            lengths = torch.tensor(seq_lens, device=device)
            data["decode_rows"] = torch.tensor(decode_rows, device=device)
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
        flat_keys.index_copy_(0, metadata.slot_mapping, key)
        flat_values.index_copy_(0, metadata.slot_mapping, value)

        data = metadata.backend_data
        output = torch.empty_like(query)
        for start, end, slots, mask in data["prefills"]:
            q = query[start:end].transpose(0, 1)  # [heads, query_len, head_dim]
            k = flat_keys[slots].transpose(0, 1)
            v = flat_values[slots].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            output[start:end] = out.transpose(0, 1)

        rows = data["decode_rows"]
        if rows is not None:
            slots = data["decode_slots"]
            q = query[rows].unsqueeze(2)  # [batch, heads, 1, head_dim]
            k = flat_keys[slots].transpose(1, 2)  # [batch, kv_heads, max_len, head_dim]
            v = flat_values[slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=data["decode_mask"], scale=scale, enable_gqa=True
            )
            output[rows] = out.squeeze(2)
        return output
