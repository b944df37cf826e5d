"""The batch description every attention backend reads, and the KV cache layout they share.
Built once per step by the model runner's InputBatch (replicas/execution/input_batch.py).

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V). Token slot s lives at block s // block_size, offset s % block_size.

Queries are packed: sequence b owns query rows query_start_loc[b]:query_start_loc[b+1], which are
the *last* query_len tokens of its context of seq_lens[b] tokens (positions
seq_lens[b]-query_len .. seq_lens[b]-1), attending causally to its whole context. Decode is
query_len == 1; prefill, chunked prefill and prefix-cache hits are all the same shape.

A layer with a sliding window W sees only keys i - W + 1 .. i from query position i (see
kernels/reference.py). Block-table entries wholly before every query's window may then be
placeholders for blocks the block manager dropped: no backend reads them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's KV cache tensor: the layout above, written once."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, num_layers: int,
                             dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers (K and V): what sizes the cache."""
    per_layer = math.prod(kv_cache_shape(1, block_size, num_kv_heads, head_dim))
    return per_layer * num_layers * dtype.itemsize


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32 (padding entries are 0)
    # Host-side copies, so CPU paths never sync on a device tensor.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]  # [batch + 1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """From plain lists, token by token: the spec the runner's InputBatch is tested against."""
        slots = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            query_start_loc_cpu=starts,
        )
