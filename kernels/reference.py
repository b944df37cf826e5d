"""Pure-torch paged attention and KV store: the spec every other backend must match.

Written for clarity, one sequence at a time, computing in float32.
"""
from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> their slots in kv_cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0, slot_mapping] = key.to(kv_cache.dtype)
    flat[1, slot_mapping] = value.to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len cached K and V of one sequence: [seq_len, num_kv_heads, head_dim] each."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, nb, bs, h, d]
    blocks = blocks.flatten(1, 2)[:, :seq_len]
    return blocks[0], blocks[1]


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape and dtype."""
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for b in range(metadata.num_seqs):
        start = int(metadata.query_start_loc[b])
        q_len = metadata.query_lens_cpu[b]
        s_len = metadata.seq_lens_cpu[b]
        k, v = gather_kv(kv_cache, metadata.block_tables[b], s_len)
        k = k.float().repeat_interleave(group, dim=1)  # [s, h, d]
        v = v.float().repeat_interleave(group, dim=1)
        q = query[start:start + q_len].float()  # [q, h, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        k_pos = torch.arange(s_len, device=query.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
