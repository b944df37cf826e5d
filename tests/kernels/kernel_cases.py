"""Random paged-attention batches for the kernel tests (no side effects: safe for subprocesses)."""
from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


class Case:
    """A random batch: a KV cache whose blocks are scattered, queries, and their metadata.

    seqs is a list of (query_len, seq_len); the cache already holds every sequence's first
    seq_len - query_len tokens, and key/value hold the query tokens' new K/V (not yet stored).
    packed: query, key and value are strided views of one [tokens, heads + 2 * kv_heads, head_dim]
    tensor, as a model's fused QKV projection hands them over.
    """

    def __init__(self, seqs, *, num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                 dtype=torch.float32, device="cpu", seed=0, packed=False):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [(s_len + block_size - 1) // block_size for _, s_len in seqs]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks, so no table is an identity map
        # Block 0 is also the padding entry of block tables: give it to no sequence, fill it with
        # garbage, so a kernel that reads past a table's end is caught.
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        tables, taken = [], 0
        for n in blocks_per_seq:
            tables.append(ids[taken:taken + n])
            taken += n
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.kv_cache[:, 0] = 1e4 if dtype != torch.float16 else 6e4
        num_tokens = sum(q for q, _ in seqs)
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        self.query, self.key, self.value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        if not packed:
            self.query, self.key, self.value = (t.contiguous() for t in (self.query, self.key, self.value))
        self.metadata = AttentionMetadata.build([q for q, _ in seqs], [s for _, s in seqs], tables,
                                                block_size, device=device)
        self.scale = head_dim ** -0.5
        self.dtype = dtype

    def stored_cache(self, store_kv):
        cache = self.kv_cache.clone()
        store_kv(self.key, self.value, cache, self.metadata.slot_mapping)
        return cache


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
