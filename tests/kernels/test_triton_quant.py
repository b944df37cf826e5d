"""The Triton dequant-GEMM against pagedserve.kernels.reference.quant_linear. Without a GPU it runs in
Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), so shapes are small and the matrix is
chosen, not crossed, where a cross adds nothing; compile_for_gpu.py compiles the same kernel for a
real GPU."""
import importlib
import sys

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and "pagedserve.kernels.triton_quant" in sys.modules:
    importlib.reload(sys.modules["pagedserve.kernels.triton_quant"])  # decorated before TRITON_INTERPRET was set

from tests.kernels.kernel_cases import assert_close  # noqa: E402
from pagedserve.kernels import reference, triton_quant  # noqa: E402
from pagedserve.kernels.quantized import QuantWeight, pack_values  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_weight(n, k, bits, group_size, *, act_order=False, seed=0) -> QuantWeight:
    """Values over the whole range; scales and zero points so that W is O(1 / sqrt(k)) and the
    outputs O(1), the offsets' zero term cancelling part of s * q as in real formats."""
    gen = torch.Generator().manual_seed(seed)
    levels = 2 ** bits
    values = torch.randint(0, levels, (n, k), generator=gen)
    groups = k // group_size
    scales = (0.5 + torch.rand(n, groups, generator=gen)) * 4 / (levels * k ** 0.5)
    zeros = torch.rand(n, groups, generator=gen) * levels
    perm = torch.randperm(k, generator=gen) if act_order else None
    return QuantWeight(bits, group_size, pack_values(values, bits), scales, -zeros * scales, perm)


def check(x, weight, bias=None, num_splits=None):
    packed = triton_quant.pack(weight, DEVICE)
    x = x.to(DEVICE)
    bias = None if bias is None else bias.to(DEVICE)
    actual = triton_quant.linear(x, packed, bias, num_splits=num_splits)
    expected = reference.quant_linear(x.cpu(), weight, None if bias is None else bias.cpu())
    assert_close(actual.cpu(), expected, x.dtype)


CASES = [(bits, group) for bits in (4, 8) for group in (32, 64, 128, "channel")]


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("act_order", [False, True], ids=["stored_order", "act_order"])
@pytest.mark.parametrize("bits,group", CASES, ids=[f"w{b}_g{g}" for b, g in CASES])
def test_matches_reference(bits, group, act_order, bias):
    # Rows, k and a ragged n rotate over the cases, so each shows up with every option.
    index = CASES.index((bits, group)) + 2 * act_order + bias
    k = 128 if group == 128 else (64, 128)[index // 2 % 2]
    n = (16, 40)[index % 2]
    rows = (1, 5, 33)[index % 3]
    group_size = k if group == "channel" else group
    weight = random_weight(n, k, bits, group_size, act_order=act_order, seed=index)
    gen = torch.Generator().manual_seed(index)
    check(torch.randn(rows, k, generator=gen), weight,
          torch.randn(n, generator=gen) if bias else None)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 65, 130])
def test_row_buckets(rows):
    # Each M bucket (decode, medium, prefill tiles) at and across its edges, ragged rows masked.
    bits = 4 if rows % 2 else 8
    weight = random_weight(40, 64, bits, 32, act_order=True, seed=rows)
    check(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)), weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 33])
def test_activation_dtypes(dtype, rows):
    weight = random_weight(40, 128, 4, 64, act_order=True, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    check(torch.randn(rows, 128, generator=gen).to(dtype), weight, torch.randn(40, generator=gen).to(dtype))


@pytest.mark.parametrize("num_splits", [2, 3, 16])  # 16: more splits than k tiles, clamped
def test_split_k(num_splits):
    weight = random_weight(40, 128, 4, 32, seed=num_splits)
    gen = torch.Generator().manual_seed(num_splits)
    check(torch.randn(5, 128, generator=gen), weight, torch.randn(40, generator=gen), num_splits=num_splits)


def test_split_k_chosen_for_a_small_grid():
    config = triton_quant.choose_config(1, 128)
    device = torch.device("cpu")  # 8 SMs, as the heuristic sees the interpreter
    assert triton_quant.choose_num_splits(1, 16, 512, config, device) == 2  # k // MIN_SPLIT_K
    assert triton_quant.choose_num_splits(1, 40, 8192, config, device) == 16  # two waves of 8 SMs
    assert triton_quant.choose_num_splits(1, 576, 8192, config, device) == 1  # 9 programs: enough
    assert triton_quant.choose_num_splits(64, 16, 8192, triton_quant.choose_config(64, 128), device) > 1
    check(torch.randn(1, 512), random_weight(16, 512, 8, 128, seed=1), torch.randn(16))  # takes 2


def test_signed_8bit_blocks():
    # Q8_0 as QuantWeight stores q + 128 with offset -128 * d: the offset term cancels s * q.
    gen = torch.Generator().manual_seed(3)
    signed = torch.randint(-128, 128, (16, 64), generator=gen)
    d = torch.rand(16, 2, generator=gen) / 64
    weight = QuantWeight(8, 32, pack_values(signed + 128, 8), d, -128 * d)
    check(torch.randn(5, 64, generator=gen), weight)


def test_leading_dims_and_empty_rows():
    weight = random_weight(16, 64, 4, 32, seed=4)
    packed = triton_quant.pack(weight, DEVICE)
    x = torch.randn(2, 3, 64, device=DEVICE)
    out = triton_quant.linear(x, packed)
    assert out.shape == (2, 3, 16)
    assert_close(out.cpu(), reference.quant_linear(x.cpu().view(6, 64), weight).view(2, 3, 16), x.dtype)
    assert triton_quant.linear(x[:0, 0], packed).shape == (0, 16)


def test_pack_layout():
    # 4 bits: value j of a word in bits 4j..4j+3, k along words' rows, n along columns.
    values = torch.arange(16).repeat(3, 1) % 16  # n = 3, k = 16
    weight = QuantWeight(4, 16, pack_values(values, 4), torch.ones(3, 1), torch.zeros(3, 1))
    packed = triton_quant.pack(weight, "cpu")
    assert packed.qweight.dtype == torch.int32 and packed.qweight.shape == (2, 3)
    assert packed.qweight[0].tolist() == [0x76543210] * 3
    assert packed.qweight[1].tolist() == [0xFEDCBA98 - 2**32] * 3
    assert packed.shape == (3, 16) and packed.scales.shape == (1, 3)
    eight = triton_quant.pack(weight.as_format(8, 16), "cpu")
    assert eight.qweight.shape == (4, 3) and eight.qweight[0, 0].item() == 0x03020100


def test_rejects_bad_input():
    weight = random_weight(16, 64, 4, 32)
    with pytest.raises(ValueError, match="group_size a multiple of 16"):
        triton_quant.pack(QuantWeight(4, 8, weight.q, weight.scales.repeat_interleave(4, 1),
                                      weight.offsets.repeat_interleave(4, 1)), "cpu")
    with pytest.raises(ValueError, match="input features"):
        triton_quant.linear(torch.randn(2, 32), triton_quant.pack(weight, "cpu"))
