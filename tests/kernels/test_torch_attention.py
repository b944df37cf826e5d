"""The CPU fast path against the reference, over shapes, dtypes and batch mixes."""
import random

import pytest
import torch

from tests.kernels.kernel_cases import SOFT_CAP, WINDOW_BATCHES, Case, assert_close
from pagedserve.kernels import reference, torch_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 4), (9, 3), (8, 2)]  # (query heads, KV heads): GQA ratios 1, 3, 4
_rng = random.Random(0)
BATCHES = {
    "context_1": [(1, 1)],
    "block_boundaries": [(1, 15), (1, 16), (1, 17), (1, 32), (1, 33)],
    "ragged_decode": [(1, _rng.randint(1, 300)) for _ in range(9)],
    "prefill": [(33, 33)],
    "prefix_cached_chunk": [(20, 70)],
    "mixed": [(1, 40), (17, 17), (1, 1), (9, 64), (1, 200), (16, 32)],
}


def check(case: Case) -> None:
    cache = case.stored_cache(reference.store_kv)
    assert torch.equal(case.stored_cache(torch_attention.store_kv), cache)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    actual = torch_attention.paged_attention(case.query, cache, case.metadata, case.scale)
    assert_close(actual, expected, case.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", BATCHES)
def test_matches_reference(batch, block_size, head_dim, heads, dtype):
    check(Case(BATCHES[batch], num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
               block_size=block_size, dtype=dtype))


@pytest.mark.parametrize("block_size", [1, 5, 8])
def test_odd_block_sizes(block_size):
    check(Case(BATCHES["mixed"], num_heads=6, num_kv_heads=2, block_size=block_size))


def test_packed_qkv_views():
    check(Case(BATCHES["mixed"], num_heads=9, num_kv_heads=3, packed=True))


@pytest.mark.parametrize("seqs", [[(1, 100)] * 6, [(1, n) for n in (5, 90, 17, 64, 33, 120)]],
                         ids=["equal", "ragged"])
def test_decode_groups(monkeypatch, seqs):
    # A tiny group budget splits the decodes into several groups (padded and masked, or trimmed).
    monkeypatch.setattr(torch_attention, "DECODE_GROUP_BYTES", 100 * 2 * 2 * 64 * 4 * 2)
    check(Case(seqs, num_heads=6, num_kv_heads=2))


def test_empty_batch():
    case = Case([], num_heads=4, num_kv_heads=2)
    out = torch_attention.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("soft_cap", [None, SOFT_CAP], ids=["no_cap", "soft_cap"])
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,seqs,window", WINDOW_BATCHES, ids=[b[0] for b in WINDOW_BATCHES])
def test_sliding_window_matches_reference(name, seqs, window, dtype, use_native, soft_cap):
    case = Case(seqs, num_heads=6, num_kv_heads=2, block_size=8, dtype=dtype, sliding_window=window,
                packed=True)
    cache = case.stored_cache(reference.store_kv)
    kwargs = dict(sliding_window=window, logits_soft_cap=soft_cap)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale, **kwargs)
    actual = torch_attention.paged_attention(case.query, cache, case.metadata, case.scale,
                                             use_native=use_native, **kwargs)
    assert_close(actual, expected, case.dtype)


def test_soft_cap_without_window():
    case = Case(BATCHES["mixed"], num_heads=9, num_kv_heads=3)
    cache = case.stored_cache(reference.store_kv)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale, logits_soft_cap=SOFT_CAP)
    for use_native in (True, False):
        actual = torch_attention.paged_attention(case.query, cache, case.metadata, case.scale,
                                                 logits_soft_cap=SOFT_CAP, use_native=use_native)
        assert_close(actual, expected, torch.float32)


def test_windowed_decode_groups(monkeypatch):
    monkeypatch.setattr(torch_attention, "DECODE_GROUP_BYTES", 30 * 2 * 2 * 64 * 4 * 2)
    case = Case([(1, n) for n in (5, 90, 17, 64, 33, 120)], num_heads=6, num_kv_heads=2,
                sliding_window=24)
    cache = case.stored_cache(reference.store_kv)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale, sliding_window=24)
    actual = torch_attention.paged_attention(case.query, cache, case.metadata, case.scale,
                                             sliding_window=24, use_native=False)
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("window", [13, None])
def test_windowed_prefill_query_tiles(monkeypatch, window):
    # Tiles smaller than the chunks: each gathers its own span of blocks.
    monkeypatch.setattr(torch_attention, "PREFILL_QUERY_TILE", 16)
    case = Case([(70, 70), (20, 120), (33, 33), (1, 50)], num_heads=6, num_kv_heads=2, block_size=8,
                sliding_window=window)
    cache = case.stored_cache(reference.store_kv)
    kwargs = dict(sliding_window=window, logits_soft_cap=SOFT_CAP)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale, **kwargs)
    actual = torch_attention.paged_attention(case.query, cache, case.metadata, case.scale, **kwargs)
    assert_close(actual, expected, torch.float32)
