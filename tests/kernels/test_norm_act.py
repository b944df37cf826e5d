"""pagedserve.kernels.norm_act: the dispatching layer the model calls equals the torch formulas on every path."""
import pytest
import torch

from pagedserve.kernels import native, native_norm_act, norm_act

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 100)])
def test_rms_norm_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    torch.testing.assert_close(norm_act.rms_norm(x, weight, 1e-6),
                               norm_act.rms_norm_reference(x, weight, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_normed_sum_and_sum(dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(9, 576, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(dtype)
    expected_sum = x + residual
    expected = norm_act.rms_norm_reference(expected_sum, weight, 1e-5)
    out, new_residual = norm_act.rms_norm(x.clone(), weight, 1e-5, residual.clone())
    torch.testing.assert_close(new_residual, expected_sum, **_tol(dtype))
    torch.testing.assert_close(out, expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 13])
def test_silu_and_mul_matches_formula(dtype, rows):
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)).to(dtype)
    torch.testing.assert_close(norm_act.silu_and_mul(x), norm_act.silu_and_mul_reference(x), **_tol(dtype))


def test_native_path_is_taken_for_float32(monkeypatch):
    if not native.available():
        pytest.skip("no native CPU kernels here")
    calls = []
    monkeypatch.setattr(native_norm_act, "silu_and_mul", lambda out, x: calls.append("silu") or out.zero_())
    monkeypatch.setattr(native_norm_act, "rms_norm", lambda out, x, w, eps: calls.append("norm") or out.zero_())
    norm_act.silu_and_mul(torch.ones(2, 8))
    norm_act.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)
    assert calls == ["silu", "norm"]
