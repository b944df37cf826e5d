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

from kernels import cpu_features, cpu_linear, native

ROOT = Path(__file__).resolve().parents[2]
GEMM_LEVELS = ["avx2", "avx512"]

ROWS = [1, 2, 5, 6, 7, 13, 64, cpu_linear.MKL_MIN_ROWS - 1, cpu_linear.MKL_MIN_ROWS, 700]


def _onednn_pack(weight):
    return cpu_linear.PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(weight, 64),
                                   weight.shape[0])


def _runs_here(level):
    levels = cpu_features.LEVELS
    return levels.index(cpu_features.detected_level()) >= levels.index(level)


def _level_pack(level):
    def pack(weight):
        if not native.linear_available() or not _runs_here(level):
            pytest.skip(f"no {level} GEMM on this CPU")
        return cpu_linear.PackedWeight("native", native.pack_linear_weight(weight, level), weight.shape[0])
    return pack


def _native_pack(weight):
    if not native.linear_available():
        pytest.skip("no native GEMM on this machine")
    return cpu_linear.PackedWeight("native", native.pack_linear_weight(weight), weight.shape[0])


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
    torch.testing.assert_close(native.linear(x, packed.tensor, 48), F.linear(x, weight),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("level", GEMM_LEVELS)
def test_every_level_compiles_with_its_own_panel(level):
    """Each level's GEMM builds on any x86 compiler, whatever this CPU runs."""
    if cpu_features.detected_level() == "native" or not native.available():
        pytest.skip("not an x86 CPU with AVX2")
    path = native._build(native._compiler(), level)
    assert path.exists() and path.parent.name.startswith(f"{level}-")
    if _runs_here(level):
        assert native.linear_panel(level) == {"avx2": 16, "avx512": 48}[level]


def test_loaded_level_packs_for_itself():
    if not native.linear_available():
        pytest.skip("no native GEMM on this machine")
    assert native.cpu_level() == cpu_features.cpu_level()
    packed = cpu_linear.pack(torch.randn(100, 83))
    assert packed.tensor.shape[2] == native.linear_panel() == native.linear_panel(native.cpu_level())


def test_level_override_forces_avx2():
    if not _runs_here("avx2") or not native.available():
        pytest.skip("no AVX2 on this CPU")
    code = ("import torch, torch.nn.functional as F\nfrom kernels import cpu_linear, native\n"
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
        native.linear(torch.randn(3, 17), packed.tensor, 32)  # inner size differs
    with pytest.raises(ValueError):
        native.linear(torch.randn(3, 16).double(), packed.tensor, 32)
    with pytest.raises(ValueError):
        native.linear(torch.randn(3, 16), packed.tensor, 32, bias=torch.randn(31))
    with pytest.raises(ValueError):  # more outputs than the panels hold
        native.linear(torch.randn(3, 16), packed.tensor, packed.tensor.shape[0] * packed.tensor.shape[2] + 1)
    with pytest.raises(ValueError):  # a panel width no loaded level packs
        native.linear(torch.randn(3, 16), torch.randn(1, 16, 24), 24)


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
