"""Triton kernels against the reference. Without a GPU they run in Triton's interpreter (seconds a
launch), so the matrix is chosen case by case rather than crossed; test_triton_compile.py checks
that the same launches compile for a real GPU."""
import pytest
import torch

from tests.kernels.kernel_cases import SOFT_CAP, Case, assert_close
from pagedserve.kernels import reference, triton_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BOUNDARY_DECODES = [(1, 1), (1, 16), (1, 17), (1, 32), (1, 150)]  # contexts 1, at/over block edges
MIXED = [(1, 40), (70, 90), (1, 1), (9, 9), (1, 33), (16, 16)]  # decodes, a 2-tile chunk over a prefix


def run(case: Case, num_splits=None, logits_soft_cap=None) -> None:
    cache = case.stored_cache(reference.store_kv)
    kwargs = dict(sliding_window=case.sliding_window, logits_soft_cap=logits_soft_cap)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale, **kwargs)
    actual = triton_attention.paged_attention(case.query, cache, case.metadata, case.scale,
                                              num_splits=num_splits, **kwargs)
    assert_close(actual, expected, case.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(block_size, dtype):
    case = Case(MIXED, num_heads=9, num_kv_heads=3, block_size=block_size, dtype=dtype, device=DEVICE,
                packed=True)
    assert torch.equal(case.stored_cache(triton_attention.store_kv), case.stored_cache(reference.store_kv))


def test_store_kv_skips_padding_slots():
    case = Case([(4, 4)], device=DEVICE)
    case.metadata.slot_mapping[1] = -1
    cache = case.stored_cache(triton_attention.store_kv)
    case.metadata.slot_mapping = case.metadata.slot_mapping[[0, 2, 3]]
    case.key, case.value = case.key[[0, 2, 3]], case.value[[0, 2, 3]]
    assert torch.equal(cache, case.stored_cache(reference.store_kv))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(num_splits, dtype):
    run(Case(BOUNDARY_DECODES, num_heads=9, num_kv_heads=3, dtype=dtype, device=DEVICE), num_splits)


@pytest.mark.parametrize("heads,head_dim,block_size,num_splits", [
    ((4, 4), 128, 32, 1),  # no grouping, the larger head_dim and block
    ((8, 2), 128, 16, 4),  # GQA 4, split-K with more splits than some contexts have tiles
    ((6, 2), 80, 8, 2),  # head_dim padded to 128, blocks smaller than a tile
])
def test_decode_shapes(heads, head_dim, block_size, num_splits):
    seqs = [(1, 1), (1, 17), (1, 129)]
    run(Case(seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
             block_size=block_size, device=DEVICE), num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_decode_and_chunked_prefill(dtype):
    run(Case(MIXED, num_heads=9, num_kv_heads=3, dtype=dtype, device=DEVICE, packed=True), num_splits=2)


@pytest.mark.parametrize("heads,head_dim,block_size", [((4, 4), 128, 32), ((8, 2), 64, 16), ((6, 2), 80, 8)])
def test_prefill_shapes(heads, head_dim, block_size):
    # Prefills only (no decode launch): a fresh prompt and a chunk after a cached prefix.
    run(Case([(20, 20), (5, 37)], num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
             block_size=block_size, dtype=torch.float16, device=DEVICE))


@pytest.mark.parametrize("window,soft_cap,num_splits", [
    (20, None, 1),  # a window shorter than most contexts, reaching into a block partway
    (37, SOFT_CAP, 3),  # split-K over the window only, soft-capped
    (1000, None, 2),  # longer than every context: plain causal attention
])
def test_sliding_window_decode(window, soft_cap, num_splits):
    seqs = [(1, 1), (1, 17), (1, 37), (1, 150), (1, 333)]
    run(Case(seqs, num_heads=9, num_kv_heads=3, block_size=8, device=DEVICE, sliding_window=window),
        num_splits, soft_cap)


@pytest.mark.parametrize("window,soft_cap", [(24, None), (13, SOFT_CAP), (70, None)])
def test_sliding_window_prefill(window, soft_cap):
    # Two query tiles of a fresh prompt (the second starts past the window), a chunk after a
    # prefix whose first blocks are dropped, and a decode beside them.
    seqs = [(70, 70), (20, 120), (1, 90)]
    run(Case(seqs, num_heads=4, num_kv_heads=2, block_size=8, device=DEVICE, sliding_window=window),
        num_splits=1, logits_soft_cap=soft_cap)


def test_automatic_split_choice():
    case = Case([(1, 2000), (1, 3)], num_heads=9, num_kv_heads=3, device=DEVICE)
    splits = triton_attention.choose_num_splits(case.metadata, case.kv_cache, 9)
    assert splits > 1
    run(case)


def test_choose_num_splits():
    # Few programs and long contexts split; many programs or short contexts do not.
    many = Case([(1, 40)] * 64, num_kv_heads=1)
    short = Case([(1, 300)], num_kv_heads=1)
    prefill = Case([(30, 30)], num_kv_heads=1)
    for case in (many, short, prefill):
        assert triton_attention.choose_num_splits(case.metadata, case.kv_cache, 4) == 1


def test_empty_batch():
    case = Case([], device=DEVICE)
    assert triton_attention.paged_attention(case.query, case.kv_cache, case.metadata, case.scale).numel() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, None, 8])
def test_cuda_large(num_splits, dtype):
    seqs = [(1, n) for n in (1, 16, 17, 511, 4096, 9000)] + [(300, 300), (1000, 5000), (64, 1024)]
    run(Case(seqs, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype, device="cuda"), num_splits)
