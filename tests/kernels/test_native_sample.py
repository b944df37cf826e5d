"""The random sampler's native draw (csrc/sample.c) against pagedserve.kernels.reference.sample_rows, on every
CPU level this CPU runs: the same token but where the target sits at a rounding's distance from a
boundary of the CDF, never a token of zero probability, exact proportions over a grid of uniforms,
and argmax's answer on rows without a distribution."""
import pytest
import torch

from pagedserve.kernels import cpu_features, native, native_sample, reference

if not native.available():
    pytest.skip("native CPU kernels unavailable (no C compiler, or PAGEDSERVE_NATIVE=0)",
                allow_module_level=True)

BF16, F32 = torch.bfloat16, torch.float32
_DETECTED = cpu_features.LEVELS.index(cpu_features.detected_level())
LEVELS = [None] + [lv for lv in ("avx2", "avx512", "avx512_bf16")
                   if _DETECTED >= cpu_features.LEVELS.index(lv)]
LEVEL_IDS = ["loaded" if lv is None else lv for lv in LEVELS]
# The largest u below 1 in float64, and 0: the ends of the range.
U_MAX = 1.0 - 2.0 ** -53


def _uniforms(rows: int, seed: int) -> torch.Tensor:
    u = torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    u[0] = 0.0
    if rows > 1:
        u[-1] = U_MAX
    return u


def _assert_matches_reference(x, u, scales, level):
    got = native_sample.sample_rows(x, u, scales, level=level)
    want = reference.sample_rows(x.float(), u, scales)
    probs = torch.softmax(x.double() * (1.0 if scales is None else scales.double()[:, None]), dim=-1)
    cdf = probs.cumsum(dim=-1)
    for r in range(x.shape[0]):
        i = int(got[r])
        assert probs[r, i] > 0, f"row {r}: token {i} has probability 0"
        if i == int(want[r]):
            continue
        # Sums in another order: only a target within rounding of the boundary may move.
        target = float(u[r]) * float(cdf[r, -1])
        boundary = float(cdf[r, min(i, int(want[r]))])
        assert abs(boundary - target) < 1e-5, (r, i, int(want[r]))


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 49152), (32, 49152), (7, 1000), (3, 63), (2, 64),
                                   (5, 65), (4, 129)], ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["scale1", "scaled"])
def test_sample_rows_matches_the_reference(level, dtype, shape, scaled):
    rows, n = shape
    gen = torch.Generator().manual_seed(n + rows)
    x = (torch.randn(rows, n + 3, generator=gen) * 3).to(dtype)[:, 2:-1]  # strided rows
    if n > 8:
        x[:, 1::3] = float("-inf")  # what top-k / top-p / min-p leave
    scales = torch.rand(rows, generator=gen) * 2 + 0.2 if scaled else None
    _assert_matches_reference(x, _uniforms(rows, n), scales, level)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_zero_probability_entries_are_never_drawn(level):
    """Whatever the uniform, down to 0 and up to the last float64 below 1: a single kept token
    at either end of a row, or in its middle, is the one drawn."""
    n = 1000
    for kept in (0, 1, 63, 64, 500, n - 1):
        x = torch.full((9, n), float("-inf"))
        x[:, kept] = 2.5
        u = torch.tensor([0.0, 1e-300, 0.25, 0.5, 0.75, 0.999, 1 - 1e-12, U_MAX, 0.1], dtype=torch.float64)
        assert native_sample.sample_rows(x, u, level=level).tolist() == [kept] * 9


def test_a_grid_of_uniforms_draws_each_token_in_proportion():
    """Evenly spaced uniforms: each token drawn at its probability, to within one step of the grid."""
    probs = torch.tensor([0.05, 0.0, 0.4, 1e-3, 0.2, 0.349])
    steps = 10000
    u = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
    x = probs.log().expand(steps, -1).contiguous()
    counts = torch.bincount(native_sample.sample_rows(x, u), minlength=len(probs))
    assert torch.allclose(counts / steps, probs / probs.sum(), atol=1.5 / steps)
    scales = torch.full((steps,), 0.5)  # temperature 2
    tempered = torch.bincount(native_sample.sample_rows(x, u, scales), minlength=len(probs))
    expected = probs.sqrt() / probs.sqrt().sum()
    assert torch.allclose(tempered / steps, expected, atol=1.5 / steps)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_rows_without_a_distribution_take_argmax_answer(dtype):
    """A NaN: the first NaN; a +inf: the first +inf; nothing finite: index 0 (as the greedy argmax)."""
    x = torch.randn(4, 300).to(dtype)
    x[0, 17] = x[0, 200] = float("nan")
    x[1, 40] = x[1, 41] = float("inf")
    x[2] = float("-inf")
    x[3, 5] = float("nan")
    x[3, 9] = float("inf")
    u = torch.full((4,), 0.5, dtype=torch.float64)
    assert native_sample.sample_rows(x, u).tolist() == [17, 40, 0, 5]


def test_sample_rows_refuses_what_it_cannot_read():
    u = torch.zeros(2, dtype=torch.float64)
    for bad in [torch.randn(3), torch.randn(2, 0), torch.randn(4, 2).t(), torch.randn(2, 3).double(),
                torch.randn(2, 3).half()]:
        assert not native_sample.usable(bad)
        with pytest.raises(ValueError):
            native_sample.sample_rows(bad, u)
    x = torch.randn(2, 5)
    for uniforms, scales in [(u.float(), None), (torch.zeros(3, dtype=torch.float64), None),
                             (u, torch.ones(2, dtype=torch.float64)), (u, torch.ones(3))]:
        with pytest.raises(ValueError):
            native_sample.sample_rows(x, uniforms, scales)
