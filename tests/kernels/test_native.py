"""The native C kernels against the torch references, and their input checks (their build:
test_native_build.py)."""
import pytest
import torch

from pagedserve.kernels import (
    cpu_features,
    native,
    native_attention,
    native_norm_act,
    norm_act,
    reference,
    torch_attention,
)
from tests.kernels.kernel_cases import SOFT_CAP, Case, assert_close

if not native.available():
    pytest.skip("native CPU kernels unavailable (no C compiler, or PAGEDSERVE_NATIVE=0)",
                allow_module_level=True)

# Ragged contexts: 1, block boundaries for every block size used below, long ones.
CONTEXTS = [1, 2, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100, 255, 256, 257, 599, 600]
SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (9, 3, 64, 16),  # the default model
    (4, 4, 64, 16),  # MHA
    (8, 2, 128, 16),
    (6, 2, 64, 8),
    (4, 1, 128, 32),
    (4, 2, 80, 5),  # head dims of other whole vectors in the tiled forms: Phi-2's
    (3, 1, 32, 16),  # bench.serving_overhead's tiny model's, three query heads a KV head
    (4, 4, 96, 16),  # Phi-3's
    (4, 2, 40, 5),  # not whole vectors of 16: the portable loop
    (2, 1, 256, 16),  # more vectors than the tiled forms hold: the portable loop
]

# Decode attention has a tiled form per ISA (csrc/paged_attention.c): the loaded level's, and the
# AVX2 one where this CPU runs a higher level.
DECODE_LEVELS = [None] + (["avx2"] if cpu_features.LEVELS.index(cpu_features.detected_level())
                          > cpu_features.LEVELS.index("avx2") else [])
DECODE_LEVEL_IDS = ["loaded" if lv is None else lv for lv in DECODE_LEVELS]


def decode_rows(case: Case) -> torch.Tensor:
    """Mask of the query rows that belong to decode sequences."""
    lens = torch.tensor(case.metadata.query_lens_cpu)
    return (lens == 1).repeat_interleave(lens)


def run_native(case: Case, cache: torch.Tensor, fill: float = float("nan"),
               kernel=native_attention.paged_decode_attention, **kwargs) -> torch.Tensor:
    out = torch.full(case.query.shape, fill)
    m = case.metadata
    kernel(out, case.query, cache, m.block_tables, m.seq_lens, m.query_start_loc, case.scale,
           **kwargs)
    return out


def run_native_prefill(case: Case, cache: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    return run_native(case, cache, fill, native_attention.paged_prefill_attention)


def assert_each_raises(kernel, args: dict, bad: dict) -> None:
    """kernel(**args) runs; with any one argument replaced by one of its bad values, ValueError."""
    kernel(**args)
    for name, values in bad.items():
        for value in values:
            with pytest.raises(ValueError):
                kernel(**{**args, name: value})


@pytest.mark.parametrize("level", DECODE_LEVELS, ids=DECODE_LEVEL_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_decode_matches_reference(shape, level):
    heads, kv_heads, head_dim, block_size = shape
    case = Case([(1, n) for n in CONTEXTS], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size)
    cache = case.stored_cache(reference.store_kv)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    assert_close(run_native(case, cache, level=level), expected, torch.float32)


def test_mixed_batch_leaves_prefill_rows():
    case = Case([(1, 40), (17, 17), (1, 1), (9, 64), (1, 200), (16, 32)], num_heads=9, num_kv_heads=3)
    cache = case.stored_cache(reference.store_kv)
    out = run_native(case, cache, fill=7.0)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    rows = decode_rows(case)
    assert_close(out[rows], expected[rows], torch.float32)
    assert torch.all(out[~rows] == 7.0)


# Fresh prefills at block boundaries and beyond a task's tile of positions (96 rows: 32 positions
# of the default model's 3 query heads per KV head), chunked prefills, and decodes left alone.
PREFILLS = [(2, 2), (5, 5), (16, 16), (17, 17), (32, 32), (33, 33), (100, 100), (257, 257),
            (7, 40), (16, 33), (33, 64), (50, 600), (1, 9), (1, 100)]


@pytest.mark.parametrize("shape", [s for s in SHAPES if native_attention.supports_prefill(s[2])],
                         ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("packed", [False, True], ids=["contiguous", "packed_qkv"])
def test_prefill_matches_reference(shape, packed):
    heads, kv_heads, head_dim, block_size = shape
    case = Case(PREFILLS, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, packed=packed)
    cache = case.stored_cache(reference.store_kv)
    out = run_native_prefill(case, cache, fill=7.0)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    rows = ~decode_rows(case)
    assert_close(out[rows], expected[rows], torch.float32)
    assert torch.all(out[~rows] == 7.0)


def test_prefill_with_more_query_heads_per_kv_head_than_a_tile_has_rows():
    # 100 query heads on one KV head: a task is one position, its rows the 100 heads.
    case = Case([(5, 5), (3, 20), (1, 7)], num_heads=100, num_kv_heads=1, head_dim=16)
    cache = case.stored_cache(reference.store_kv)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    rows = ~decode_rows(case)
    assert_close(run_native_prefill(case, cache)[rows], expected[rows], torch.float32)


# Tasks are (sequence, KV head, tile of positions), each computed the same on any thread.
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)], ids=str)
def test_prefill_threads_agree(heads):
    case = Case(PREFILLS, num_heads=heads[0], num_kv_heads=heads[1])
    cache = case.stored_cache(reference.store_kv)
    torch.set_num_threads(1)  # the autouse fixture restores the thread count
    one = run_native_prefill(case, cache, fill=0.0)
    torch.set_num_threads(2)
    assert torch.equal(one, run_native_prefill(case, cache, fill=0.0))


def test_prefill_bad_inputs_raise():
    case = Case([(1, 20), (3, 3), (4, 40)], num_heads=4, num_kv_heads=2)
    m, q, cache = case.metadata, case.query, case.kv_cache
    args = dict(out=torch.empty_like(q), query=q, kv_cache=cache, block_tables=m.block_tables,
                seq_lens=m.seq_lens, query_start_loc=m.query_start_loc, scale=case.scale)
    bad = {
        "query": [q.double(), q.transpose(1, 2), q[:, :3]],
        "kv_cache": [cache.half(), cache[0], cache[:, :, :, :1]],
        "block_tables": [m.block_tables.long(), m.block_tables[:2],
                         torch.full_like(m.block_tables, cache.shape[1])],
        # a prefill's seq_len below its query length, or beyond its block table
        "seq_lens": [torch.tensor([20, 2, 40], dtype=torch.int32),
                     torch.tensor([20, 3, 10_000], dtype=torch.int32)],
        "query_start_loc": [torch.tensor([0, 1, 4, 99], dtype=torch.int32),
                            torch.tensor([0, 4, 1, 8], dtype=torch.int32)],
    }
    assert_each_raises(native_attention.paged_prefill_attention, args, bad)
    odd = Case([(3, 3)], num_heads=4, num_kv_heads=2, head_dim=40)
    with pytest.raises(ValueError, match="multiple of 16"):
        native_attention.paged_prefill_attention(
            torch.empty_like(odd.query), odd.query, odd.kv_cache, odd.metadata.block_tables,
            odd.metadata.seq_lens, odd.metadata.query_start_loc, odd.scale)


@pytest.mark.parametrize("head_dim", [64, 40], ids=["native", "torch_head_dim_40"])
def test_torch_attention_prefills(head_dim):
    """Prefills take the native kernel where it applies, and SDPA for the rest, alike."""
    case = Case(PREFILLS, num_heads=6, num_kv_heads=2, head_dim=head_dim)
    cache = case.stored_cache(torch_attention.store_kv)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    assert_close(torch_attention.paged_attention(case.query, cache, case.metadata, case.scale),
                 expected, torch.float32)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("packed", [False, True], ids=["contiguous", "packed_qkv"])
def test_torch_attention_dispatch(use_native, packed):
    case = Case([(1, 40), (17, 17), (1, 1), (9, 64), (1, 600), (16, 32), (1, 33)], num_heads=9,
                num_kv_heads=3, packed=packed)
    cache = case.stored_cache(torch_attention.store_kv)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    actual = torch_attention.paged_attention(case.query, cache, case.metadata, case.scale,
                                             use_native=use_native)
    assert_close(actual, expected, torch.float32)


def test_torch_attention_without_native(monkeypatch, restore_available):
    monkeypatch.setenv("PAGEDSERVE_NATIVE", "0")
    assert not native.available()
    case = Case([(1, 40), (9, 64), (1, 200)], num_heads=6, num_kv_heads=2)
    cache = case.stored_cache(torch_attention.store_kv)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    assert_close(torch_attention.paged_attention(case.query, cache, case.metadata, case.scale),
                 expected, torch.float32)


# Per-KV-head tasks (few sequences) and per-sequence ones give the 1-thread result bit for bit.
@pytest.mark.parametrize("num_seqs", [1, 2, 5, 40])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)], ids=str)
def test_threads_agree(num_seqs, heads):
    case = Case([(1, 1 + 37 * i % 500) for i in range(num_seqs)], num_heads=heads[0],
                num_kv_heads=heads[1])
    cache = case.stored_cache(reference.store_kv)
    torch.set_num_threads(1)  # the autouse fixture restores the thread count
    one = run_native(case, cache)
    torch.set_num_threads(2)
    two = run_native(case, cache)
    assert torch.equal(one, two)


@pytest.mark.parametrize("shape", [(1, 576), (7, 1000), (64, 576), (3, 1), (2, 5, 64)], ids=str)
def test_rms_norm(shape):
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(shape, generator=gen), torch.randn(shape[-1], generator=gen)
    eps = 1e-5
    expected = norm_act.rms_norm_reference(x, weight, eps)
    out = torch.empty_like(x)
    native_norm_act.rms_norm(out, x, weight, eps)
    assert_close(out, expected, torch.float32)

    residual = torch.randn(shape, generator=gen)
    new_residual = residual + x
    expected = norm_act.rms_norm_reference(new_residual, weight, eps)
    x = x.clone()
    native_norm_act.fused_add_rms_norm(x, residual, weight, eps)
    assert_close(residual, new_residual, torch.float32)
    assert_close(x, expected, torch.float32)


@pytest.mark.parametrize("shape", [(1, 1536), (7, 1000), (64, 1536), (3, 1), (2, 5, 64)], ids=str)
def test_silu_and_mul(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 4
    x.view(-1)[:8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 200.0, -200.0])[:x.numel()]
    out = torch.empty(shape)
    native_norm_act.silu_and_mul(out, x)
    assert_close(out, norm_act.silu_and_mul_reference(x), torch.float32)


def test_threads_agree_norm_act():
    x, weight = torch.randn(300, 1000), torch.randn(1000)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out, act = torch.empty_like(x), torch.empty(300, 500)
        native_norm_act.rms_norm(out, x, weight, 1e-6)
        native_norm_act.silu_and_mul(act, x)
        outs.append((out, act))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_bad_inputs_raise():
    case = Case([(1, 20), (3, 3), (1, 40)], num_heads=4, num_kv_heads=2)
    m, q, cache = case.metadata, case.query, case.kv_cache
    args = dict(out=torch.empty_like(q), query=q, kv_cache=cache, block_tables=m.block_tables,
                seq_lens=m.seq_lens, query_start_loc=m.query_start_loc, scale=case.scale)
    bad = {
        "query": [q.double(), q.to(torch.bfloat16), q.transpose(1, 2), q[:, :3]],
        "out": [args["out"].double(), torch.empty(q.shape[0], q.shape[2], q.shape[1]).transpose(1, 2),
                torch.empty(q.shape[0] + 1, *q.shape[1:])],
        "kv_cache": [cache.half(), cache.transpose(1, 2), cache[0], cache[:, :, :, :1]],
        "block_tables": [m.block_tables.long(), m.block_tables.t(), m.block_tables[:2],
                         torch.full_like(m.block_tables, cache.shape[1])],
        "seq_lens": [m.seq_lens.long(), m.seq_lens[:2], torch.tensor([20, 3, 10_000], dtype=torch.int32),
                     torch.tensor([0, 3, 40], dtype=torch.int32)],
        "query_start_loc": [m.query_start_loc.long(), torch.tensor([0, 1, 4, 99], dtype=torch.int32),
                            torch.tensor([0, 4, 1, 5], dtype=torch.int32)],
    }
    assert_each_raises(native_attention.paged_decode_attention, args, bad)

    x, weight = torch.randn(4, 64), torch.randn(64)
    for call in [lambda: native_norm_act.rms_norm(torch.empty_like(x), x.double(), weight.double(), 1e-6),
                 lambda: native_norm_act.rms_norm(torch.empty(64, 4).t(), x, weight, 1e-6),
                 lambda: native_norm_act.rms_norm(torch.empty_like(x), x.t(), weight, 1e-6),
                 lambda: native_norm_act.rms_norm(torch.empty_like(x), x, torch.randn(32), 1e-6),
                 lambda: native_norm_act.rms_norm(torch.empty(4, 32), x, weight, 1e-6),
                 lambda: native_norm_act.fused_add_rms_norm(x, torch.randn(4, 32), weight, 1e-6),
                 lambda: native_norm_act.fused_add_rms_norm(x, torch.randn(64, 4).t(), weight, 1e-6),
                 lambda: native_norm_act.fused_add_rms_norm(x.half(), x.half(), weight, 1e-6),
                 lambda: native_norm_act.silu_and_mul(torch.empty(4, 32), x.double()),
                 lambda: native_norm_act.silu_and_mul(torch.empty(4, 31), x),
                 lambda: native_norm_act.silu_and_mul(torch.empty(3, 32), x),
                 lambda: native_norm_act.silu_and_mul(torch.empty(4, 32), torch.randn(64, 4).t())]:
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("soft_cap", [None, SOFT_CAP], ids=["no_cap", "soft_cap"])
@pytest.mark.parametrize("window", [1, 7, 16, 100, 1000])
@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[5:6], ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("level", DECODE_LEVELS, ids=DECODE_LEVEL_IDS)
def test_windowed_decode_matches_reference(level, shape, window, soft_cap):
    heads, kv_heads, head_dim, block_size = shape
    case = Case([(1, n) for n in CONTEXTS], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, sliding_window=window)
    cache = case.stored_cache(reference.store_kv)
    kwargs = dict(sliding_window=window, logits_soft_cap=soft_cap)
    expected = reference.paged_attention(case.query, cache, case.metadata, case.scale, **kwargs)
    m = case.metadata
    out = torch.full(case.query.shape, float("nan"))
    native_attention.paged_decode_attention(out, case.query, cache, m.block_tables, m.seq_lens,
                                            m.query_start_loc, case.scale, level=level, **kwargs)
    assert_close(out, expected, torch.float32)


def test_windowed_decode_checks_only_the_window():
    # Entries outside the window may be anything (dropped blocks); inside it they are checked.
    case = Case([(1, 100)], num_heads=4, num_kv_heads=2, block_size=8, sliding_window=20)
    cache = case.stored_cache(reference.store_kv)
    m = case.metadata
    m.block_tables[0, :9] = -5  # positions 0..71: all before the window (80..99)
    out = torch.empty_like(case.query)
    native_attention.paged_decode_attention(out, case.query, cache, m.block_tables, m.seq_lens,
                                            m.query_start_loc, case.scale, sliding_window=20)
    m.block_tables[0, 10] = -5
    with pytest.raises(ValueError, match="block table entry"):
        native_attention.paged_decode_attention(out, case.query, cache, m.block_tables, m.seq_lens,
                                                m.query_start_loc, case.scale, sliding_window=20)


def test_rows_contiguous_is_the_first_rows_contiguity():
    base = torch.randn(3, 4 * 8 + 16)
    layouts = {
        "contiguous": torch.randn(3, 4, 8),
        "rows of a fused qkv": base[:, :32].view(3, 4, 8),
        "heads transposed": torch.randn(3, 8, 4).transpose(1, 2),
        "head_dim sliced": torch.randn(3, 4, 16)[:, :, :8],
        "every other dim": torch.randn(3, 4, 16)[:, :, ::2],
        "one head, strided": torch.randn(3, 2, 8)[:, :1],
        "head_dim 1, strided heads": torch.randn(3, 4, 2)[:, :, :1],
    }
    for name, query in layouts.items():
        assert native_attention.rows_contiguous(query) == query[0].is_contiguous(), name
