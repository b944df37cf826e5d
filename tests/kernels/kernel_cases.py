"""Random paged-attention batches for the kernel tests (no side effects: safe for subprocesses)."""
from __future__ import annotations

import torch

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.reference import first_key_position

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


class Case:
    """A random batch: a KV cache whose blocks are scattered, queries, and their metadata.

    seqs is a list of (query_len, seq_len); the cache already holds every sequence's first
    seq_len - query_len tokens, and key/value hold the query tokens' new K/V (not yet stored).
    packed: query, key and value are strided views of one [tokens, heads + 2 * kv_heads, head_dim]
    tensor, as a model's fused QKV projection hands them over.
    sliding_window: the blocks wholly older than every query's window are dropped, as the block
    manager drops them: their table entries point at the last cache block, which holds NaN, so a
    kernel that reads a dropped block (even masked) returns NaN.
    """

    def __init__(self, seqs, *, num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                 dtype=torch.float32, device="cpu", seed=0, packed=False, sliding_window=None):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [(s_len + block_size - 1) // block_size for _, s_len in seqs]
        num_blocks = sum(blocks_per_seq) + 4  # spare blocks, so no table is an identity map
        # Block 0 is also the padding entry of block tables: give it to no sequence, fill it with
        # garbage, so a kernel that reads past a table's end is caught. The last is the dropped one.
        dropped = num_blocks - 1
        ids = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()
        tables, taken = [], 0
        for (q_len, s_len), n in zip(seqs, blocks_per_seq):
            table = ids[taken:taken + n]
            num_dropped = first_key_position(s_len, q_len, sliding_window) // block_size
            tables.append([dropped] * num_dropped + table[num_dropped:])
            taken += n
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.kv_cache[:, 0] = 1e4 if dtype != torch.float16 else 6e4
        if sliding_window is not None:
            self.kv_cache[:, dropped] = float("nan")
        num_tokens = sum(q for q, _ in seqs)
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        self.query, self.key, self.value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        if not packed:
            self.query, self.key, self.value = (t.contiguous() for t in (self.query, self.key, self.value))
        self.metadata = AttentionMetadata.build([q for q, _ in seqs], [s for _, s in seqs], tables,
                                                block_size, device=device)
        self.scale = head_dim ** -0.5
        self.dtype = dtype
        self.sliding_window = sliding_window

    def stored_cache(self, store_kv):
        cache = self.kv_cache.clone()
        store_kv(self.key, self.value, cache, self.metadata.slot_mapping)
        return cache


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# Sliding-window batches, as (name, seqs, window): windows shorter than, equal to and longer than
# the contexts, over decode, fresh prefill and chunked-prefill shapes, each window reaching into a
# block partway so the first kept block is partly masked.
WINDOW_BATCHES = [
    ("decode_short", [(1, 1), (1, 16), (1, 17), (1, 40), (1, 150), (1, 333)], 20),
    ("decode_equal", [(1, 37), (1, 37)], 37),
    ("decode_long", [(1, 5), (1, 90)], 500),
    ("prefill_short", [(70, 70), (33, 33)], 24),
    ("prefill_equal", [(40, 40)], 40),
    ("chunked_short", [(20, 120), (5, 64), (17, 17)], 30),
    ("mixed_short", [(1, 40), (9, 64), (1, 1), (16, 32), (1, 200), (50, 90)], 13),
    ("mixed_long", [(1, 40), (9, 64), (16, 32)], 1000),
]
SOFT_CAP = 1.5  # small against these random scores (|q.k| * scale up to ~4), so the cap matters
