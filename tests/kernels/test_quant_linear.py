"""The weight-only quantized GEMM (kernels/quant_linear.py, csrc/gemm_q.c) of every CPU level this
CPU runs, and its dequantized "dense" fallback, against pagedserve.kernels.reference.quant_linear."""
import pytest
import torch

from pagedserve.kernels import cpu_features, native, quant_linear, reference
from pagedserve.kernels.quantized import QuantWeight, pack_values

KERNEL_LEVELS = ["avx2", "avx512", "avx512_bf16"]


def _runs_here(level):
    levels = cpu_features.LEVELS
    return levels.index(cpu_features.detected_level()) >= levels.index(level)


def _levels():
    """Each native level this CPU runs, then the dense fallback (which runs everywhere)."""
    params = [pytest.param(level, marks=pytest.mark.skipif(
        not (native.available() and _runs_here(level)), reason=f"no {level} kernel on this CPU"))
        for level in KERNEL_LEVELS]
    return [*params, "dense"]


LEVELS = _levels()


def random_weight(n, k, bits, group_size, *, symmetric=False, perm=False, seed=0) -> QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    groups = k // group_size
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    # Symmetric formats fold their zero point into the offset (kernels/quantized.py).
    offsets = (-(2 ** (bits - 1)) * scales if symmetric
               else torch.randn(n, groups, generator=gen) * 0.02)
    order = torch.randperm(k, generator=gen) if perm else None
    return QuantWeight(bits, group_size, pack_values(values, bits), scales, offsets, order)


def half_scaled(weight: QuantWeight) -> QuantWeight:
    """weight with scales and offsets that are IEEE halves, as GGUF's are."""
    return QuantWeight(weight.bits, weight.group_size, weight.q, weight.scales.half().float(),
                       weight.offsets.half().float(), weight.perm)


def assert_matches(out, x, weight, bias=None, spec=reference.quant_linear):
    expected = spec(x, weight, bias)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    # fp32 sums in another order; bf16 rounds the same fp32 sum once (off by one bf16 ulp at most).
    scale = expected.float().abs().max().item() + 1e-3
    tol = 2e-5 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 1536])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 65])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_matches_reference_over_groups_and_rows(level, bits, group_size, rows, symmetric):
    weight = random_weight(50, 1536, bits, group_size, symmetric=symmetric, seed=rows)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
    packed = quant_linear.pack(weight, level)
    assert packed.kind == ("dense" if level == "dense" else f"q{bits}")
    assert packed.panel == {"avx2": 16, "avx512": 48, "avx512_bf16": 48, "dense": 0}[level]
    assert_matches(quant_linear.linear(x, packed), x, weight)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [1, 17, 960])
@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("rows", [1, 8])
def test_ragged_n_and_other_k(level, n, k, rows):
    weight = random_weight(n, k, 4, 32, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    assert_matches(quant_linear.linear(x, quant_linear.pack(weight, level)), x, weight)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [3, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perm_bias_dtype_and_strided_rows(level, bits, rows, dtype):
    weight = random_weight(50, 576, bits, 64, perm=True, seed=bits)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 576, generator=gen).to(dtype)[:, 100:676]  # rows 1152 elements apart
    bias = torch.randn(50, generator=gen).to(dtype)
    packed = quant_linear.pack(weight, level)
    assert packed.perm is not None and torch.equal(packed.perm, weight.perm)
    assert_matches(quant_linear.linear(x, packed, bias), x, weight, bias)
    assert_matches(quant_linear.linear(x, packed, bias.float()), x, weight, bias.float())


def check_bf16_rows(level, rows: int, perm: bool, k: int, group_size: int, bits: int) -> None:
    """bf16 rows, strided with an odd offset and contiguous, with a bf16 bias and without."""
    weight = random_weight(50, k, bits, group_size, perm=perm, seed=rows + k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * k, generator=gen).bfloat16()[:, 3:3 + k]
    bias = torch.randn(50, generator=gen).bfloat16()
    packed = quant_linear.pack(weight, level)
    assert_matches(quant_linear.linear(x, packed, bias), x, weight, bias)
    assert_matches(quant_linear.linear(x.contiguous(), packed), x, weight)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows", [33, 64, 133])
@pytest.mark.parametrize("perm", [False, True], ids=["inorder", "perm"])
@pytest.mark.parametrize("k, group_size, bits", [(576, 32, 4), (1536, 128, 8), (45, 15, 8)])
def test_bf16_rows_past_the_direct_path(level, rows, perm, k, group_size, bits):
    """bf16 rows beyond decode's (past Q_DIRECT_PAIR_ROWS, 32) take the bf16 pair panels on
    AVX512-BF16 (an even k; an odd one stays on the fp32 scratch panel): the weights round to bf16
    there, the sums stay fp32."""
    torch.set_num_threads(2)  # the autouse one_thread fixture restores it
    check_bf16_rows(level, rows, perm, k, group_size, bits)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 16, 17, 32])
@pytest.mark.parametrize("perm", [False, True], ids=["inorder", "perm"])
@pytest.mark.parametrize("k, group_size, bits", [(576, 32, 4), (1536, 1536, 4), (576, 16, 8),
                                                 (1536, 1536, 8), (90, 45, 8)])
def test_bf16_rows_on_the_direct_path(level, rows, perm, k, group_size, bits):
    """bf16 decode rows on AVX512-BF16 take the direct path's pairs (csrc/gemm_q_direct.c, up to
    Q_DIRECT_PAIR_ROWS): the packed integers widen to bf16 pairs exactly, per-channel groups fold
    every 64 values, one or two rows alternate accumulators; an odd fold block (8 bits, group 45)
    stays on the fp32 direct path."""
    check_bf16_rows(level, rows, perm, k, group_size, bits)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("threads", [1, 2])
def test_two_threads_split_the_panels(level, threads):
    weight = random_weight(960, 576, 4, 32)
    packed = quant_linear.pack(weight, level)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 4, 16, 32):
            for dtype in (torch.float32, torch.bfloat16):  # bf16 decode rows: the direct path's pairs
                x = torch.randn(rows, 576).to(dtype)
                assert_matches(quant_linear.linear(x, packed), x, weight)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
def test_per_channel_groups_with_a_large_activation_mean(level, bits):
    """s * sum(x q) + o * sum(x) cancels over long groups: the kernel folds often enough."""
    weight = random_weight(96, 1536, bits, 1536, symmetric=True)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(1)) + 10
    assert_matches(quant_linear.linear(x, quant_linear.pack(weight, level)), x, weight)


def test_odd_4bit_groups_run_as_8bit():
    weight = random_weight(20, 30, 4, 3)  # nibble pairs would straddle the groups of 3
    packed = quant_linear.pack(weight)
    x = torch.randn(2, 30)
    assert_matches(quant_linear.linear(x, packed), x, weight)


@pytest.mark.skipif(not quant_linear.available(), reason="no native quantized kernel here")
def test_loaded_level_packs_fewer_bytes_in_its_panel_width():
    weight = random_weight(960, 576, 4, 32)
    packed = quant_linear.pack(weight)
    panel = quant_linear.panel_width()
    assert packed.kind == "q4" and packed.panel == panel == {"avx2": 16, "avx512": 48,
                                                            "avx512_bf16": 48}[native.cpu_level()]
    # 4 bits + an fp32 scale and offset per 32 values: 0.75 bytes a value, against fp32's 4.
    assert packed.nbytes == 960 * 576 * 3 // 4
    # Scales and offsets that are halves (GGUF's) pack as halves: 0.625 bytes a value.
    assert quant_linear.pack(half_scaled(weight)).nbytes == 960 * 576 * 5 // 8
    assert quant_linear.pack(weight, "dense").nbytes >= 960 * 576 * 4


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 1536])
@pytest.mark.parametrize("rows", [1, 13, 65])
def test_half_scales_and_offsets_pack_as_halves(level, bits, group_size, rows):
    """GGUF's scales are halves: packed as such (fewer bytes), with the same values."""
    weight = half_scaled(random_weight(50, 1536, bits, group_size, seed=rows))
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
    packed = quant_linear.pack(weight, level)
    if level != "dense":
        assert packed.scale_offsets.dtype == torch.float16
    assert_matches(quant_linear.linear(x, packed), x, weight)


def test_empty_rows():
    packed = quant_linear.pack(random_weight(17, 64, 4, 16))
    assert quant_linear.linear(torch.empty(0, 64), packed).shape == (0, 17)


@pytest.mark.parametrize("level", LEVELS)
def test_bad_input_is_a_value_error(level):
    packed = quant_linear.pack(random_weight(17, 64, 4, 16), level)
    with pytest.raises(ValueError, match=r"\[rows, 64\]"):
        quant_linear.linear(torch.randn(2, 63), packed)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quant_linear.linear(torch.randn(2, 64).half(), packed)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quant_linear.linear(torch.randn(64), packed)
    with pytest.raises(ValueError, match="bias"):
        quant_linear.linear(torch.randn(2, 64), packed, torch.randn(16))
    with pytest.raises(ValueError, match="bias"):
        quant_linear.linear(torch.randn(2, 64), packed, torch.randn(17).double())


@pytest.mark.skipif(not quant_linear.available(), reason="no native quantized kernel here")
def test_a_layout_the_kernel_cannot_run_is_a_value_error():
    packed = quant_linear.pack(random_weight(17, 64, 4, 16))
    with pytest.raises(ValueError, match="group size"):
        quant_linear.linear(torch.randn(2, 64), packed._replace(group_size=24))


def test_perm_out_of_range_is_refused_at_pack():
    weight = random_weight(4, 64, 8, 16)
    bad = QuantWeight(8, 16, weight.q, weight.scales, weight.offsets, torch.arange(64) + 1)
    with pytest.raises(ValueError, match="perm"):
        quant_linear.pack(bad)


# The int8-activation kernel (csrc/gemm_q_i8.c): AVX-512 levels on CPUs with VNNI.
def _i8_levels():
    vnni = "avx512_vnni" in cpu_features.cpu_flags()
    return [pytest.param(level, marks=pytest.mark.skipif(
        not (native.available() and _runs_here(level) and vnni), reason=f"no {level} + VNNI here"))
        for level in ("avx512", "avx512_bf16")]


I8_LEVELS = _i8_levels()


def assert_matches_int8(out, x, weight, bias=None):
    assert_matches(out, x, weight, bias, spec=quant_linear.int8_activation_reference)


@pytest.mark.parametrize("level", I8_LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 576])
@pytest.mark.parametrize("rows", [1, 3, 17, 65])
@pytest.mark.parametrize("halves", [False, True], ids=["f32so", "f16so"])
def test_int8_activations_match_their_reference(level, bits, group_size, rows, halves):
    weight = random_weight(130, 576, bits, group_size, symmetric=bits == 8, seed=rows)
    weight = half_scaled(weight) if halves else weight
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0  # an all-zero block: dx 0
    packed = quant_linear.pack(weight, level, activations="int8")
    assert packed.kind == f"w{bits}a8" and packed.panel == 64
    assert packed.scale_offsets.dtype == (torch.float16 if halves else torch.float32)
    assert_matches_int8(quant_linear.linear(x, packed), x, weight)


@pytest.mark.parametrize("level", I8_LEVELS)
@pytest.mark.parametrize("n", [1, 50, 960])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations_ragged_n_perm_bias_dtype_threads(level, n, threads, dtype):
    weight = random_weight(n, 1536, 4, 32, perm=True, seed=n)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(4, 2 * 1536, generator=gen).to(dtype)[:, 7:1543]  # strided rows
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = quant_linear.pack(weight, level, activations="int8")
    torch.set_num_threads(threads)  # the autouse one_thread fixture restores it
    assert_matches_int8(quant_linear.linear(x, packed, bias), x, weight, bias)


def test_int8_activation_reference_is_close_to_the_exact_spec():
    weight = random_weight(64, 576, 4, 32)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    exact = reference.quant_linear(x, weight)
    approx = quant_linear.int8_activation_reference(x, weight)
    # Each activation is off by at most half a step of amax / 127 of its block.
    assert (approx - exact).abs().max() < 0.02 * exact.abs().max()
    assert not torch.equal(approx, exact)


@pytest.mark.parametrize("level", LEVELS)
def test_int8_activations_fall_back_to_the_float_kernel(level):
    """Where the int8 kernel cannot take a weight (groups not whole blocks of 32, no VNNI, the
    AVX2 level, the dense fallback) packing keeps the float32-activation kernel."""
    for weight in (random_weight(50, 576, 4, 16), random_weight(50, 576, 8, 32)):
        packed = quant_linear.pack(weight, level, activations="int8")
        vnni = level in ("avx512", "avx512_bf16") and "avx512_vnni" in cpu_features.cpu_flags()
        takes_int8 = vnni and weight.group_size % 32 == 0
        assert packed.kind == (f"w{weight.bits}a8" if takes_int8 else
                               "dense" if level == "dense" else f"q{weight.bits}")
        x = torch.randn(2, 576)
        (assert_matches_int8 if takes_int8 else assert_matches)(quant_linear.linear(x, packed), x, weight)


def test_activations_setting(monkeypatch):
    weight = random_weight(50, 576, 4, 32)
    monkeypatch.delenv(quant_linear.ACTIVATIONS_ENV, raising=False)
    assert quant_linear.activations_setting() == "float32"
    assert quant_linear.pack(weight).kind in ("q4", "dense")  # the exact kernel by default
    monkeypatch.setenv(quant_linear.ACTIVATIONS_ENV, "INT8")
    assert quant_linear.activations_setting() == "int8"
    monkeypatch.setenv(quant_linear.ACTIVATIONS_ENV, "int4")
    with pytest.raises(ValueError, match="float32, int8"):
        quant_linear.activations_setting()
