"""CPU projections: the native panel GEMM and oneDNN's packed kernel equal F.linear at every batch
size the dispatcher routes to them, with and without bias, on one and two threads."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear, native

ROWS = [1, 2, 5, 6, 7, 13, 64, cpu_linear.MKL_MIN_ROWS - 1, cpu_linear.MKL_MIN_ROWS, 700]


def _onednn_pack(weight):
    return cpu_linear.PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(weight, 64),
                                   weight.shape[0])


def _native_pack(weight):
    if not native.linear_available():
        pytest.skip("no native GEMM on this machine")
    return cpu_linear.PackedWeight("native", native.pack_linear_weight(weight), weight.shape[0])


@pytest.mark.parametrize("packer", [_native_pack, _onednn_pack], ids=["native", "onednn"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_f_linear(packer, rows, bias, threads):
    gen = torch.Generator().manual_seed(rows)
    # 100 outputs: six full 16-column panels and a partial one; an odd inner size.
    weight = torch.randn(100, 83, generator=gen)
    b = torch.randn(100, generator=gen) if bias else None
    x = torch.randn(rows, 83, generator=gen)
    packed = packer(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_linear.linear(x, weight, packed, b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_native_linear_reads_strided_rows():
    weight = torch.randn(48, 32)
    packed = _native_pack(weight)
    wide = torch.randn(9, 80)
    x = wide[:, 8:40]  # rows 80 floats apart, as a slice of a fused projection's output
    torch.testing.assert_close(native.linear(x, packed.tensor, 48), F.linear(x, weight),
                               rtol=1e-5, atol=1e-4)


def test_native_linear_rejects_bad_input():
    packed = _native_pack(torch.randn(32, 16))
    with pytest.raises(ValueError):
        native.linear(torch.randn(3, 17), packed.tensor, 32)  # inner size differs
    with pytest.raises(ValueError):
        native.linear(torch.randn(3, 16).double(), packed.tensor, 32)
    with pytest.raises(ValueError):
        native.linear(torch.randn(3, 16), packed.tensor, 32, bias=torch.randn(31))
    with pytest.raises(ValueError):
        native.linear(torch.randn(3, 16), packed.tensor, 40)  # more outputs than panels hold


def test_pack_picks_the_fastest_kernel_and_frees_nothing_it_still_needs():
    weight = torch.randn(8, 4)
    packed = cpu_linear.pack(weight)
    expected = "native" if native.linear_available() else "onednn"
    assert packed.kind == expected and packed.replaces_weight == (expected == "native")
    x = torch.randn(3, 4)
    torch.testing.assert_close(cpu_linear.linear(x, torch.empty(0) if packed.replaces_weight else weight,
                                                 packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_unpacked_weight_falls_back_to_f_linear():
    weight, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(cpu_linear.linear(x, weight, None), F.linear(x, weight))


def test_pack_refuses_what_no_kernel_can_take_instead_of_raising():
    packed = cpu_linear.pack(torch.randn(8, 4).bfloat16())  # oneDNN needs AVX-512 for bf16 on x86
    assert packed is None or packed.kind == "onednn"
