"""The packed oneDNN linear equals F.linear at every batch size the dispatcher routes."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 7, 64, cpu_linear.MKL_MIN_ROWS - 1, cpu_linear.MKL_MIN_ROWS, 700])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_f_linear(rows, bias, threads):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    packed = cpu_linear.pack(weight)
    assert packed is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_linear.linear(x, weight, packed, b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_unpacked_weight_falls_back_to_f_linear():
    weight, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(cpu_linear.linear(x, weight, None), F.linear(x, weight))


def test_pack_refuses_what_onednn_cannot_pack_instead_of_raising():
    packed = cpu_linear.pack(torch.randn(8, 4).bfloat16())  # needs AVX-512 on x86
    if packed is not None:  # this CPU can: then it must compute the same thing
        x = torch.randn(3, 4).bfloat16()
        out = cpu_linear.linear(x, torch.randn(8, 4).bfloat16(), packed)
        assert out.shape == (3, 8)

