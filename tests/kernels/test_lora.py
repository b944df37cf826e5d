"""The batched multi-LoRA delta: the native kernel (csrc/lora.c), the torch fallback and the Triton
shrink / expand pair against pagedserve.kernels.reference.lora_delta_reference. Shapes are chosen,
not crossed, so each T, K, N, R and S shows up beside the others; every dtype pair and slot pattern
runs on every shape. Triton runs in its interpreter without a GPU (conftest.py), on a few small
cases only."""
import ctypes
import importlib
import sys

import pytest
import torch
from pagedserve.kernels import lora, native, reference

if not torch.cuda.is_available() and "pagedserve.kernels.triton_lora" in sys.modules:
    importlib.reload(sys.modules["pagedserve.kernels.triton_lora"])  # decorated before TRITON_INTERPRET was set

F32, BF16 = torch.float32, torch.bfloat16
# (T, K, N, R, S)
SHAPES = [(1, 16, 8, 1, 1), (1, 576, 960, 16, 4), (3, 16, 96, 8, 4), (3, 576, 8, 16, 1),
          (17, 576, 96, 1, 4), (17, 16, 960, 8, 1), (64, 576, 960, 8, 4), (64, 16, 96, 16, 4)]
DTYPES = [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32)]  # (x and out, lora_a and lora_b_t)
PATTERNS = ["none", "one", "mixed", "short_ranks"]
needs_native = pytest.mark.skipif(not native.available(), reason="native CPU kernels unavailable")


def make_case(shape, dtypes, pattern, *, seed=0, sliced=True, device="cpu"):
    """(x, wide, out, token_slots, lora_a, lora_b_t, ranks): out a column slice of `wide` (or all
    of it), x with strided rows. short_ranks: ranks below R (0 included) with NaN in the unused
    rank rows, which must never reach the result."""
    tokens, k, n, max_rank, slots = shape
    data, weight = dtypes
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k + 3, generator=gen)[:, :k]
    lora_a = torch.randn(slots, max_rank, k, generator=gen) / k ** 0.5
    lora_b_t = torch.randn(slots, max_rank, n, generator=gen) / max_rank ** 0.5
    ranks = torch.full((slots,), max_rank, dtype=torch.int32)
    if pattern == "none":
        token_slots = torch.full((tokens,), -1, dtype=torch.int32)
    elif pattern == "one":
        token_slots = torch.full((tokens,), slots - 1, dtype=torch.int32)
    else:
        token_slots = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
        token_slots[0] = -1 if tokens > 1 else 0
    if pattern == "short_ranks":
        ranks = torch.randint(0, max_rank, (slots,), generator=gen, dtype=torch.int32)
        ranks[0] = max_rank - 1
        for s, r in enumerate(ranks.tolist()):
            lora_a[s, r:] = float("nan")
            lora_b_t[s, r:] = float("nan")
    wide = torch.randn(tokens, n + 7 if sliced else n, generator=gen).to(data)
    out = wide[:, 3:3 + n] if sliced else wide
    return (x.to(data).to(device), wide.to(device), out.to(device), token_slots.to(device),
            lora_a.to(weight).contiguous().to(device), lora_b_t.to(weight).contiguous().to(device),
            ranks.to(device))


def expected_of(x, out, token_slots, lora_a, lora_b_t, ranks):
    expected = out.cpu().clone()
    reference.lora_delta_reference(x.cpu(), expected, token_slots.cpu(), lora_a.cpu(), lora_b_t.cpu(),
                                   ranks.cpu())
    return expected


def assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype is BF16:  # one rounding of fp32 sums that differ in order: a bf16 ulp or two
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=1e-5)
    else:
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


def run_and_check(fn, case):
    x, wide, out, token_slots, lora_a, lora_b_t, ranks = case
    expected = expected_of(x, out, token_slots, lora_a, lora_b_t, ranks)
    before = wide.clone()
    fn(x, out, token_slots, lora_a, lora_b_t, ranks)
    assert_close(out.cpu(), expected)
    # Rows without an adapter, and the columns beside the slice, are untouched.
    untouched = (token_slots.cpu() < 0).to(wide.device)
    assert torch.equal(wide[untouched], before[untouched])
    first = (out.data_ptr() - wide.data_ptr()) // wide.element_size()
    beside = torch.ones(wide.shape[1], dtype=torch.bool, device=wide.device)
    beside[first:first + out.shape[1]] = False
    assert torch.equal(wide[:, beside], before[:, beside])


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{str(d[0])[6:]}-{str(d[1])[6:]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_K{}_N{}_R{}_S{}".format(*s))
def test_native_and_torch_match_reference(shape, dtypes, pattern):
    # out is a column slice for one of the two on every shape, the whole tensor for the other.
    seed = SHAPES.index(shape)
    if native.available():
        run_and_check(lora.lora_delta, make_case(shape, dtypes, pattern, seed=seed, sliced=seed % 2 == 0))
    run_and_check(lora.lora_delta_torch, make_case(shape, dtypes, pattern, seed=seed, sliced=seed % 2 == 1))


def test_torch_fallback_without_native(monkeypatch):
    monkeypatch.setattr(lora, "usable", lambda *args: False)
    run_and_check(lora.apply, make_case((5, 48, 40, 8, 3), (BF16, BF16), "short_ranks"))


@needs_native
def test_apply_takes_the_native_kernel(monkeypatch):
    calls, native_delta = [], lora.lora_delta
    monkeypatch.setattr(lora, "lora_delta", lambda *args: calls.append(args) or native_delta(*args))
    run_and_check(lora.apply, make_case((5, 48, 40, 8, 3), (F32, F32), "mixed"))
    assert len(calls) == 1


# (shape, dtypes, pattern): one decode row over a wide N (the expand splits N between threads);
# a decode step over many slots and one over one slot at n = 576 (the shrink splits its blocks of A,
# the expand N in vectors, unevenly in tiles); a prefill chunk with short ranks.
THREAD_CASES = [((1, 576, 8192, 16, 2), (BF16, BF16), "one"), ((32, 576, 576, 64, 16), (BF16, BF16), "mixed"),
                ((32, 576, 576, 64, 1), (F32, BF16), "one"), ((256, 576, 192, 16, 4), (F32, F32), "short_ranks")]


@needs_native
@pytest.mark.parametrize("shape,dtypes,pattern", THREAD_CASES,
                         ids=["T{}_K{}_N{}_R{}_S{}".format(*c[0]) for c in THREAD_CASES])
def test_threads_split_the_work_and_agree(shape, dtypes, pattern):
    # Every element's sums run in the same order whatever the split, so the results are identical.
    x, _, out, token_slots, lora_a, lora_b_t, ranks = make_case(shape, dtypes, pattern, sliced=False)
    outs, threads_before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            o = out.clone()
            lora.lora_delta(x, o, token_slots, lora_a, lora_b_t, ranks)
            outs.append(o)
    finally:
        torch.set_num_threads(threads_before)
    assert torch.equal(*outs)
    assert_close(outs[0], expected_of(x, out, token_slots, lora_a, lora_b_t, ranks))


@needs_native
def test_exported_routine_with_caller_scratch():
    # ps_lora_delta, as csrc/decoder_layers.c calls it, with scratch of the caller's.
    lib = ctypes.CDLL(str(native.library_path()))
    lib.ps_lora_scratch_bytes.restype = ctypes.c_size_t
    lib.ps_lora_scratch_bytes.argtypes = [ctypes.c_int64] * 3
    lib.ps_lora_delta.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4
                                  + [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int])
    x, _, out, token_slots, lora_a, lora_b_t, ranks = make_case((6, 40, 24, 4, 3), (F32, BF16), "mixed")
    expected = expected_of(x, out, token_slots, lora_a, lora_b_t, ranks)
    scratch = torch.empty(lib.ps_lora_scratch_bytes(6, 3, 4), dtype=torch.uint8)
    assert lib.ps_lora_delta(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                             token_slots.data_ptr(), lora_a.data_ptr(), lora_b_t.data_ptr(),
                             ranks.data_ptr(), 6, 40, 24, 3, 4, native.BF16_WEIGHT,
                             scratch.data_ptr(), 1) == 0
    assert_close(out, expected)


@pytest.mark.parametrize("fn", ["native", "torch"])
def test_bad_slots_and_ranks_raise(fn):
    if fn == "native" and not native.available():
        pytest.skip("native CPU kernels unavailable")
    delta = lora.lora_delta if fn == "native" else lora.lora_delta_torch
    x, _, out, _, lora_a, lora_b_t, _ = make_case((4, 32, 16, 4, 2), (F32, F32), "mixed")
    before = out.clone()
    for slots, rank_values in (([0, 2, -1, 1], [4, 4]), ([0, -2, 1, 1], [4, 4]),
                               ([0, 1, -1, 1], [5, 4]), ([0, 1, -1, 1], [4, -1])):
        with pytest.raises(ValueError, match="LoRA token_slots entry"):
            delta(x, out, torch.tensor(slots, dtype=torch.int32), lora_a, lora_b_t,
                  torch.tensor(rank_values, dtype=torch.int32))
        assert torch.equal(out, before)  # checked before anything is written


def test_bad_shapes_and_dtypes_raise():
    x, _, out, token_slots, lora_a, lora_b_t, ranks = make_case((4, 32, 16, 4, 2), (F32, F32), "mixed")
    for fn in (lora.lora_delta_torch, *([lora.lora_delta] if native.available() else [])):
        with pytest.raises(ValueError, match="expected x"):
            fn(x[:, :31], out, token_slots, lora_a, lora_b_t, ranks)
        with pytest.raises(ValueError, match="expected x"):
            fn(x, out, token_slots[:3], lora_a, lora_b_t, ranks)
        with pytest.raises(ValueError, match="share one dtype"):
            fn(x, out.bfloat16(), token_slots, lora_a, lora_b_t, ranks)
        with pytest.raises(ValueError, match="share one dtype"):
            fn(x, out, token_slots, lora_a, lora_b_t.bfloat16(), ranks)
        with pytest.raises(ValueError, match="int32"):
            fn(x, out, token_slots.long(), lora_a, lora_b_t, ranks)
    if native.available():
        with pytest.raises(ValueError, match="unit column stride"):
            lora.lora_delta(x, out.T.contiguous().T, token_slots, lora_a, lora_b_t, ranks)


# (shape, dtypes, pattern): the interpreter is slow, so a handful: k tiles with a ragged end, two
# column tiles, every slot pattern and bf16 on each side.
TRITON_CASES = [((3, 16, 8, 1, 1), (F32, F32), "one"), ((4, 144, 96, 8, 4), (BF16, BF16), "short_ranks"),
                ((5, 40, 160, 16, 4), (F32, BF16), "mixed"), ((2, 16, 8, 4, 2), (F32, F32), "none"),
                ((17, 576, 960, 16, 4), (BF16, BF16), "mixed"), ((1, 576, 96, 16, 1), (BF16, F32), "one")]


@pytest.mark.parametrize("shape,dtypes,pattern", TRITON_CASES,
                         ids=["T{}_K{}_N{}_R{}_S{}".format(*c[0]) for c in TRITON_CASES])
def test_triton_matches_reference(shape, dtypes, pattern):
    pytest.importorskip("triton")
    from pagedserve.kernels import triton_lora

    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = [c[0] for c in TRITON_CASES].index(shape)
    run_and_check(triton_lora.lora_delta, make_case(shape, dtypes, pattern, seed=seed, device=device))
