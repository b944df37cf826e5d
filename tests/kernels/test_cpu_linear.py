"""CPU projections: the native panel GEMM (each CPU level's) and oneDNN's packed kernel equal
F.linear at every batch size the dispatcher routes to them, with and without bias, on one and two
threads."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_features, cpu_linear, native, native_linear

ROOT = Path(__file__).resolve().parents[2]
GEMM_LEVELS = ["avx2", "avx512", "avx512_bf16"]

ROWS = [1, 2, 5, 6, 7, 13, 64, cpu_linear.MKL_MIN_ROWS - 1, cpu_linear.MKL_MIN_ROWS, 700]


def _onednn_pack(weight):
    return cpu_linear.PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(weight, 64),
                                   weight.shape[0])


def _runs_here(level):
    levels = cpu_features.LEVELS
    return levels.index(cpu_features.detected_level()) >= levels.index(level)


def _level_pack(level):
    def pack(weight):
        if not native_linear.linear_available() or not _runs_here(level):
            pytest.skip(f"no {level} GEMM on this CPU")
        return cpu_linear.PackedWeight("native", native_linear.pack_linear_weight(weight, level), weight.shape[0])
    return pack


def _native_pack(weight):
    if not native_linear.linear_available():
        pytest.skip("no native GEMM on this machine")
    return cpu_linear.PackedWeight("native", native_linear.pack_linear_weight(weight), weight.shape[0])


@pytest.mark.parametrize("packer", [_native_pack, *map(_level_pack, GEMM_LEVELS), _onednn_pack],
                         ids=["native", *GEMM_LEVELS, "onednn"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_f_linear(packer, rows, bias, threads):
    gen = torch.Generator().manual_seed(rows)
    # 100 outputs: full panels and a partial one at every panel width (16, 48); an odd inner size.
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


@pytest.mark.parametrize("level", GEMM_LEVELS)
def test_native_linear_reads_strided_rows(level):
    weight = torch.randn(48, 32)
    packed = _level_pack(level)(weight)
    wide = torch.randn(9, 80)
    x = wide[:, 8:40]  # rows 80 floats apart, as a slice of a fused projection's output
    torch.testing.assert_close(native_linear.linear(x, packed.tensor, 48), F.linear(x, weight),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("level", GEMM_LEVELS)
def test_every_level_compiles_with_its_own_panel(level):
    """Each level's GEMM builds on any x86 compiler, whatever this CPU runs."""
    if cpu_features.detected_level() == "native" or not native.available():
        pytest.skip("not an x86 CPU with AVX2")
    path = native._build(native._compiler(), level)
    assert path.exists() and path.parent.name.startswith(f"{level}-")
    if _runs_here(level):
        assert native_linear.linear_panel(level) == {"avx2": 16, "avx512": 48, "avx512_bf16": 48}[level]


def test_loaded_level_packs_for_itself():
    if not native_linear.linear_available():
        pytest.skip("no native GEMM on this machine")
    assert native.cpu_level() == cpu_features.cpu_level()
    packed = cpu_linear.pack(torch.randn(100, 83))
    assert packed.tensor.shape[2] == native_linear.linear_panel() == native_linear.linear_panel(native.cpu_level())


def test_level_override_forces_avx2():
    if not _runs_here("avx2") or not native.available():
        pytest.skip("no AVX2 on this CPU")
    code = ("import torch, torch.nn.functional as F\nfrom pagedserve.kernels import cpu_linear, native\n"
            "w, b, x = torch.randn(100, 83), torch.randn(100), torch.randn(13, 83)\n"
            "packed = cpu_linear.pack(w)\n"
            "torch.testing.assert_close(cpu_linear.linear(x, w, packed, b), F.linear(x, w, b), "
            "rtol=1e-5, atol=1e-4)\n"
            "print(native.cpu_level(), packed.kind, packed.tensor.shape[2])")
    env = dict(os.environ, PAGEDSERVE_CPU_LEVEL="avx2")
    env.pop("PAGEDSERVE_NATIVE", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["avx2", "native", "16"]


def test_native_linear_rejects_bad_input():
    packed = _native_pack(torch.randn(32, 16))
    with pytest.raises(ValueError):
        native_linear.linear(torch.randn(3, 17), packed.tensor, 32)  # inner size differs
    with pytest.raises(ValueError):
        native_linear.linear(torch.randn(3, 16).double(), packed.tensor, 32)
    with pytest.raises(ValueError):
        native_linear.linear(torch.randn(3, 16), packed.tensor, 32, bias=torch.randn(31))
    with pytest.raises(ValueError):  # more outputs than the panels hold
        native_linear.linear(torch.randn(3, 16), packed.tensor, packed.tensor.shape[0] * packed.tensor.shape[2] + 1)
    with pytest.raises(ValueError):  # a panel width no loaded level packs
        native_linear.linear(torch.randn(3, 16), torch.randn(1, 16, 24), 24)


def test_pack_picks_the_fastest_kernel_and_frees_nothing_it_still_needs():
    weight = torch.randn(8, 4)
    packed = cpu_linear.pack(weight)
    expected = "native" if native_linear.linear_available() else "onednn"
    assert packed.kind == expected and packed.replaces_weight == (expected == "native")
    x = torch.randn(3, 4)
    torch.testing.assert_close(cpu_linear.linear(x, torch.empty(0) if packed.replaces_weight else weight,
                                                 packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_unpacked_weight_falls_back_to_f_linear():
    weight, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(cpu_linear.linear(x, weight, None), F.linear(x, weight))


def test_pack_refuses_what_no_kernel_can_take_instead_of_raising():
    packed = cpu_linear.pack(torch.randn(8, 4).bfloat16())  # oneDNN needs AVX-512 for bf16 on x86
    expected = ("native_bf16",) if native_linear.linear_bf16_available() else (None, "onednn")
    assert (packed and packed.kind) in expected


needs_bf16 = pytest.mark.skipif(not native_linear.linear_bf16_available(),
                                reason="no AVX512-BF16 GEMM on this CPU")


@needs_bf16
@pytest.mark.parametrize("tile", native_linear.BF16_TILES)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("n, k", [(100, 83), (48, 64), (49, 1), (7, 2)])  # tails in n and k
@pytest.mark.parametrize("x_dtype, bias_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float32)])
def test_bf16_linear_matches_fp32_gemm_of_rounded_inputs(tile, rows, n, k, x_dtype, bias_dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    out = native_linear.linear_bf16(x, native_linear.pack_linear_weight_bf16(weight), n, bias,
                                    widen=tile == "widen")
    # The reference: fp32 accumulation of bf16 weights and activations (widen keeps fp32 x as is).
    x_ref = x.float() if tile == "widen" else x.bfloat16().float()
    expected = x_ref @ weight.float().T + (0 if bias is None else bias.float())
    assert out.dtype == x_dtype and out.shape == (rows, n)
    if x_dtype == torch.bfloat16:  # rounded once, at the end: within a bf16 ulp
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-5)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_dispatch_matches_torch_bf16_linear(threads):
    """cpu_linear routes bf16 weights to the native kernel, frees the plain weight, and agrees
    with torch's own bf16 F.linear (oneDNN) to bf16 rounding, strided rows included."""
    gen = torch.Generator().manual_seed(threads)
    weight, bias = torch.randn(300, 96, generator=gen).bfloat16(), torch.randn(300, generator=gen).bfloat16()
    x = torch.randn(20, 130, generator=gen).bfloat16()[:, 10:106]
    packed = cpu_linear.pack(weight)
    assert packed.kind == "native_bf16" and packed.replaces_weight
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_linear.linear(x, torch.empty(0), packed, bias)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), rtol=2 ** -7, atol=1e-3)


@needs_bf16
def test_bf16_tile_choice_is_one_per_process_and_forced_by_env():
    assert native_linear.bf16_tile() in native_linear.BF16_TILES
    code = "from pagedserve.kernels import native_linear\nprint(native_linear.bf16_tile())"
    for tile in native_linear.BF16_TILES:
        env = dict(os.environ, **{native_linear.BF16_TILE_ENV: tile})
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.split() == [tile], done.stderr


@needs_bf16
def test_bf16_linear_rejects_bad_input():
    packed = native_linear.pack_linear_weight_bf16(torch.randn(32, 16).bfloat16())
    for call in [lambda: native_linear.linear_bf16(torch.randn(3, 18).bfloat16(), packed, 32),
                 lambda: native_linear.linear_bf16(torch.randn(3, 16).half(), packed, 32),
                 lambda: native_linear.linear_bf16(torch.randn(3, 16), packed, 32, torch.randn(31)),
                 lambda: native_linear.linear_bf16(torch.randn(3, 16), packed, 49),
                 lambda: native_linear.linear_bf16(torch.randn(3, 16), packed.float(), 32)]:
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("level", GEMM_LEVELS)
def test_only_the_bf16_level_has_the_bf16_gemm(level):
    if not native.available() or not _runs_here(level):
        pytest.skip(f"no {level} on this CPU")
    assert native.library(level).pagedserve_linear_bf16_panel() == (48 if level == "avx512_bf16" else 0)


@needs_bf16
def test_level_override_below_bf16_turns_bf16_off():
    """PAGEDSERVE_CPU_LEVEL=avx512 on a bf16 CPU: no bf16 GEMM, and auto dtype means float32."""
    code = ("import torch\nfrom pagedserve.kernels import cpu_features, cpu_linear, native_linear\n"
            "print(cpu_features.has_native_bf16(), native_linear.linear_bf16_available(), "
            "(cpu_linear.pack(torch.randn(8, 4).bfloat16()) or cpu_linear.PackedWeight('none', None, 0)).kind)")
    env = dict(os.environ, PAGEDSERVE_CPU_LEVEL="avx512")
    env.pop("PAGEDSERVE_NATIVE", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "onednn"]
