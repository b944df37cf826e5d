"""The native kernels' bf16 variants (RMSNorm, fused add + RMSNorm, SiLU-and-mul, paged decode
and prefill attention over a bf16 or fp32 KV cache, the greedy argmax) against the torch references,
on every CPU level this CPU runs (AVX2 included: the fallback of CPUs without AVX512-BF16), and the
dispatch that picks them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import (
    cpu_features,
    native,
    native_argmax,
    native_attention,
    native_norm_act,
    norm_act,
    reference,
    torch_attention,
)
from tests.kernels.kernel_cases import SOFT_CAP, Case

if not native.available():
    pytest.skip("native CPU kernels unavailable (no C compiler, or PAGEDSERVE_NATIVE=0)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
BF16, F32 = torch.bfloat16, torch.float32
# Every x86 level that has kernels of its own, where this CPU can run it; None: the loaded one.
_DETECTED = cpu_features.LEVELS.index(cpu_features.detected_level())
LEVELS = [None] + [lv for lv in ("avx2", "avx512", "avx512_bf16")
                   if _DETECTED >= cpu_features.LEVELS.index(lv)]
LEVEL_IDS = ["loaded" if lv is None else lv for lv in LEVELS]
NORM_SHAPES = [(1, 576), (7, 1000), (64, 576), (3, 1), (2, 5, 64), (5, 17)]
CONTEXTS = [1, 2, 7, 15, 16, 17, 33, 100, 257, 600]
ATTENTION_SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (9, 3, 64, 16),  # the default model
    (8, 2, 128, 16),
    (4, 4, 64, 8),
    (4, 2, 80, 5),  # head dims of other whole vectors in the tiled forms
    (3, 1, 32, 16),
    (4, 2, 40, 5),  # not whole vectors of 16: the portable loop
]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to the reference but for a bf16 ulp where fp32 sums, added in another order, sit at a
    rounding boundary (fp32 results: float rounding)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = dict(rtol=1e-2, atol=1e-3) if actual.dtype == BF16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("dtype, weight_dtype", [(BF16, BF16), (F32, BF16)], ids=["bf16", "fp32_bf16w"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm(level, dtype, weight_dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(weight_dtype)
    expected = norm_act.rms_norm_reference(x, weight, 1e-5)
    out = torch.empty_like(expected)
    native_norm_act.rms_norm(out, x, weight, 1e-5, level=level)
    _close(out, expected)

    residual = torch.randn(shape, generator=gen).to(dtype)
    new_residual = residual + x
    expected = norm_act.rms_norm_reference(new_residual, weight, 1e-5)
    x = x.clone()
    native_norm_act.fused_add_rms_norm(x, residual, weight, 1e-5, level=level)
    assert torch.equal(residual, new_residual)  # one rounded add, as torch's
    _close(x, expected)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("shape", [(1, 1536), (7, 1000), (64, 1536), (3, 1), (2, 5, 64)], ids=str)
def test_silu_and_mul(level, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 4
    x.view(-1)[:8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 200.0, -200.0])[:x.numel()]
    x = x.to(BF16)
    out = torch.empty(shape, dtype=BF16)
    native_norm_act.silu_and_mul(out, x, level=level)
    _close(out, norm_act.silu_and_mul_reference(x))


def _decode(case: Case, cache: torch.Tensor, level=None, **kwargs) -> torch.Tensor:
    m = case.metadata
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype)
    native_attention.paged_decode_attention(out, case.query, cache, m.block_tables, m.seq_lens,
                                            m.query_start_loc, case.scale, level=level, **kwargs)
    return out


def _expected(case: Case, cache: torch.Tensor, **kwargs) -> torch.Tensor:
    """The reference in fp32 on the same (bf16-valued) inputs, rounded once to the query's dtype."""
    return reference.paged_attention(case.query.float(), cache.float(), case.metadata, case.scale,
                                     **kwargs).to(case.query.dtype)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("dtype, kv_dtype", [(BF16, BF16), (F32, BF16), (BF16, F32)],
                         ids=["bf16", "fp32_q_bf16_kv", "bf16_q_fp32_kv"])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_decode(level, dtype, kv_dtype, shape):
    heads, kv_heads, head_dim, block_size = shape
    case = Case([(1, n) for n in CONTEXTS], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, dtype=dtype)
    cache = case.stored_cache(reference.store_kv).to(kv_dtype)
    _close(_decode(case, cache, level), _expected(case, cache))


# Fresh prefills at block boundaries and beyond a task's tile of positions, chunked prefills (a
# context already cached), and a decode the kernel leaves alone.
PREFILLS = [(2, 2), (16, 16), (17, 17), (33, 33), (100, 100), (257, 257), (7, 40), (33, 64),
            (50, 600), (1, 9)]


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("dtype, kv_dtype", [(BF16, BF16), (F32, BF16), (BF16, F32)],
                         ids=["bf16", "fp32_q_bf16_kv", "bf16_q_fp32_kv"])
@pytest.mark.parametrize("shape",
                         [s for s in ATTENTION_SHAPES if native_attention.supports_prefill(s[2])],
                         ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_prefill(level, dtype, kv_dtype, shape):
    heads, kv_heads, head_dim, block_size = shape
    case = Case(PREFILLS, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, dtype=dtype)
    cache = case.stored_cache(reference.store_kv).to(kv_dtype)
    m = case.metadata
    out = torch.full(case.query.shape, 7.0, dtype=dtype)
    native_attention.paged_prefill_attention(out, case.query, cache, m.block_tables, m.seq_lens,
                                             m.query_start_loc, case.scale, level=level)
    lens = torch.tensor(m.query_lens_cpu)
    rows = (lens > 1).repeat_interleave(lens)
    _close(out[rows], _expected(case, cache)[rows])
    assert torch.all(out[~rows] == 7.0)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 49152), (64, 49152), (7, 1000), (3, 63), (2, 64),
                                   (5, 65)], ids=str)
def test_argmax_rows(level, dtype, shape):
    """torch.argmax's answer: the first of tied maxima, the first NaN above everything, 0 for a
    row of -inf; strided rows too."""
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape[0], shape[1] + 3, generator=gen).to(dtype)[:, 2:-1]  # strided rows
    rows, n = shape
    if n > 1:
        x[0, n // 2] = x[0, n - 1] = x[0].max() + 1  # a tie: the first wins
    if rows > 2:
        x[1, n - 1] = float("nan")
        x[1, n // 3] = float("nan")
        x[2] = float("-inf")
    assert torch.equal(native_argmax.argmax_rows(x, level=level), x.argmax(dim=-1))


def test_argmax_rows_refuses_what_it_cannot_read():
    for bad in [torch.randn(3), torch.randn(3, 0), torch.randn(4, 3).t(), torch.randn(2, 3).double(),
                torch.randn(2, 3).half()]:
        assert not native_argmax.usable(bad)
        with pytest.raises(ValueError):
            native_argmax.argmax_rows(bad)


@pytest.mark.parametrize("soft_cap", [None, SOFT_CAP], ids=["no_cap", "soft_cap"])
@pytest.mark.parametrize("window", [1, 16, 100])
def test_windowed_decode(window, soft_cap):
    case = Case([(1, n) for n in CONTEXTS], num_heads=9, num_kv_heads=3, dtype=BF16, sliding_window=window)
    cache = case.stored_cache(reference.store_kv)
    kwargs = dict(sliding_window=window, logits_soft_cap=soft_cap)
    _close(_decode(case, cache, **kwargs), _expected(case, cache, **kwargs))


@pytest.mark.parametrize("num_seqs", [2, 40])  # per-KV-head and per-sequence tasks
def test_threads_agree(num_seqs):
    case = Case([(1, 1 + 37 * i % 500) for i in range(num_seqs)], num_heads=9, num_kv_heads=3, dtype=BF16)
    cache = case.stored_cache(reference.store_kv)
    x, weight = torch.randn(300, 1000).to(BF16), torch.randn(1000).to(BF16)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)  # the autouse fixture restores the thread count
        norm, act = torch.empty_like(x), torch.empty(300, 500, dtype=BF16)
        native_norm_act.rms_norm(norm, x, weight, 1e-6)
        native_norm_act.silu_and_mul(act, x)
        outs.append((_decode(case, cache), norm, act))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_mixed_batch_leaves_prefill_rows():
    case = Case([(1, 40), (17, 17), (1, 1), (9, 64)], num_heads=9, num_kv_heads=3, dtype=BF16)
    cache = case.stored_cache(reference.store_kv)
    m = case.metadata
    out = torch.full(case.query.shape, 7.0, dtype=BF16)
    native_attention.paged_decode_attention(out, case.query, cache, m.block_tables, m.seq_lens,
                                            m.query_start_loc, case.scale)
    lens = torch.tensor(m.query_lens_cpu)
    rows = (lens == 1).repeat_interleave(lens)
    _close(out[rows], _expected(case, cache)[rows])
    assert torch.all(out[~rows] == 7.0)


def test_dispatch_runs_bf16_natively(monkeypatch):
    """The model's bf16 norms, activation and decode and prefill attention take the native
    kernels."""
    calls = []
    for module, name in [(native_norm_act, "rms_norm"), (native_norm_act, "fused_add_rms_norm"),
                         (native_norm_act, "silu_and_mul"),
                         (native_attention, "paged_decode_attention"),
                         (native_attention, "paged_prefill_attention")]:
        original = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    x, residual = (torch.randn(3, 64).to(BF16) for _ in range(2))
    weight = torch.randn(64).to(BF16)
    norm_act.rms_norm(x, weight, 1e-6)
    norm_act.rms_norm(x, weight, 1e-6, residual)
    norm_act.silu_and_mul(x)
    case = Case([(1, 40), (9, 64), (1, 200)], num_heads=6, num_kv_heads=2, dtype=BF16)
    cache = case.stored_cache(torch_attention.store_kv)
    actual = torch_attention.paged_attention(case.query, cache, case.metadata, case.scale)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "paged_decode_attention",
                     "paged_prefill_attention"]
    torch.testing.assert_close(actual.float(), _expected(case, cache).float(), rtol=2e-2, atol=2e-2)


def test_bad_bf16_inputs_raise():
    x, weight = torch.randn(4, 64).to(BF16), torch.randn(64).to(BF16)
    case = Case([(1, 20), (1, 40)], num_heads=4, num_kv_heads=2, dtype=BF16)
    m = case.metadata

    def decode(out, cache):
        native_attention.paged_decode_attention(out, case.query, cache, m.block_tables, m.seq_lens,
                                                m.query_start_loc, case.scale)
    # the first: bf16 x with an fp32 weight
    for call in [lambda: native_norm_act.rms_norm(torch.empty_like(x), x, weight.float(), 1e-6),
                 lambda: native_norm_act.rms_norm(torch.empty(4, 64), x, weight, 1e-6),
                 lambda: native_norm_act.fused_add_rms_norm(x, x.float(), weight, 1e-6),
                 lambda: native_norm_act.silu_and_mul(torch.empty(4, 32), x),
                 lambda: native_norm_act.silu_and_mul(torch.empty(4, 32, dtype=BF16), x.half()),
                 lambda: decode(torch.empty(case.query.shape), case.kv_cache),  # fp32 out
                 lambda: decode(torch.empty_like(case.query), case.kv_cache.half())]:
        with pytest.raises(ValueError):
            call()


def test_forced_avx2_level_runs_the_bf16_kernels():
    """PAGEDSERVE_CPU_LEVEL=avx2 (a CPU without AVX-512): the same bf16 kernels, AVX2-compiled,
    are what the dispatch runs, and they match the references."""
    if "avx2" not in LEVELS:
        pytest.skip("no AVX2 on this CPU")
    code = """
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
from tests.kernels.kernel_cases import Case
torch.set_num_threads(1)
x, r, w = (torch.randn(5, 576).to(torch.bfloat16) for _ in range(3))
w = w[0]
tol = dict(rtol=1e-2, atol=1e-3)
torch.testing.assert_close(norm_act.rms_norm(x, w, 1e-5), norm_act.rms_norm_reference(x, w, 1e-5), **tol)
out, res = norm_act.rms_norm(x.clone(), w, 1e-5, r.clone())
assert torch.equal(res, x + r)
torch.testing.assert_close(out, norm_act.rms_norm_reference(x + r, w, 1e-5), **tol)
g = torch.randn(5, 3072).to(torch.bfloat16)
torch.testing.assert_close(norm_act.silu_and_mul(g), norm_act.silu_and_mul_reference(g), **tol)
case = Case([(1, 40), (9, 64), (1, 200)], num_heads=9, num_kv_heads=3, dtype=torch.bfloat16)
cache = case.stored_cache(torch_attention.store_kv)
calls = []
decode = native_attention.paged_decode_attention
native_attention.paged_decode_attention = lambda *a, **k: calls.append(1) or decode(*a, **k)
actual = torch_attention.paged_attention(case.query, cache, case.metadata, case.scale)
expected = reference.paged_attention(case.query.float(), cache.float(), case.metadata, case.scale)
torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-2)
print(native.cpu_level(), len(calls), cpu_features.auto_dtype())
"""
    env = dict(os.environ, PAGEDSERVE_CPU_LEVEL="avx2")
    env.pop("PAGEDSERVE_NATIVE", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["avx2", "1", "float32"]  # and auto runs fp32 there


def test_auto_dtype_is_bf16_only_where_bf16_is_native():
    assert set(cpu_features.AUTO_DTYPE) == set(cpu_features.LEVELS)
    assert {lv for lv, dtype in cpu_features.AUTO_DTYPE.items() if dtype == "bfloat16"} <= {"avx512_bf16"}
    assert cpu_features.describe()["auto_dtype"] == cpu_features.auto_dtype()
