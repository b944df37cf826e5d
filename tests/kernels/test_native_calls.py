"""The native library's own Python entry points (csrc/python_entry.c): bound where Python's headers
are, the same results as the ctypes functions of the same library, clear errors for bad calls, and
ctypes where they are turned off or cannot be built."""
import ctypes
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import (
    native,
    native_attention,
    native_linear,
    native_norm_act,
    quant_linear,
)
from pagedserve.kernels.quantized import QuantWeight, pack_values

if not native.available():
    pytest.skip("native CPU kernels unavailable", allow_module_level=True)
if not (native.PYTHON_INCLUDE / "Python.h").exists():
    pytest.skip("this interpreter's headers are not installed: ctypes only", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ctypes_lib() -> ctypes.CDLL:
    """The loaded library file again, called through ctypes only."""
    lib = ctypes.CDLL(str(native.library_path()))
    native._declare(lib)
    assert native.calls(lib) == "ctypes"
    return lib


@pytest.fixture(scope="module")
def entries():
    spec = importlib.util.spec_from_file_location("pagedserve_cpu", native.library_path())
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_entry_points_replace_every_ctypes_function():
    lib = native._library()
    assert native.calls() == "python"
    for name in native.SIGNATURES:
        assert not isinstance(getattr(lib, name), ctypes._CFuncPtr), name


def test_signatures_agree_with_the_ctypes_declarations(entries):
    assert set(entries.SIGNATURES) == set(native.SIGNATURES)
    for name in native.SIGNATURES:
        assert entries.SIGNATURES[name] == native.signature_letters(name), name


def test_panel_widths_agree(ctypes_lib):
    lib = native._library()
    for name in native.SIGNATURES:
        if name.endswith("_panel"):
            assert getattr(lib, name)() == getattr(ctypes_lib, name)(), name


def _with_library(monkeypatch, lib, fn):
    """fn() with the wrappers calling lib's functions."""
    monkeypatch.setattr(native, "_lib", lib)
    try:
        return fn()
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_activation_and_rotary_wrappers_agree(monkeypatch, ctypes_lib, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 576, generator=gen).to(dtype)
    residual = torch.randn(5, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    gate_up = torch.randn(5, 2 * 96, generator=gen).to(dtype)
    heads, kv_heads, dim = 4, 2, 32
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(5, dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([3, 0, 9, 12, 7])

    def run():
        out = torch.empty_like(x)
        native_norm_act.rms_norm(out, x, weight, 1e-5)
        fx, fr = x.clone(), residual.clone()
        native_norm_act.fused_add_rms_norm(fx, fr, weight, 1e-5)
        act = torch.empty(5, 96, dtype=dtype)
        native_norm_act.silu_and_mul(act, gate_up)
        rotated, cache = qkv.clone(), torch.zeros(2, 4, 4, kv_heads, dim, dtype=dtype)
        native_norm_act.rotary_store_kv(rotated, cos, sin, cache, slots, heads, kv_heads, dim)
        return out, fx, fr, act, rotated, cache

    fast = run()
    slow = _with_library(monkeypatch, ctypes_lib, run)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_attention_agrees(monkeypatch, ctypes_lib):
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 8, 16, 3, 64, generator=gen)
    query = torch.randn(2, 9, 64, generator=gen)
    tables = torch.tensor([[5, 1, 0], [2, 7, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 33], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)

    def run(**kw):
        out = torch.empty_like(query)
        native_attention.paged_decode_attention(out, query, kv, tables, seq_lens, starts, 0.125, **kw)
        return out

    for kw in ({}, {"sliding_window": 20, "logits_soft_cap": 30.0}):
        assert torch.equal(run(**kw), _with_library(monkeypatch, ctypes_lib, lambda: run(**kw)))


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_quant_linear_agrees(ctypes_lib, rows):
    gen = torch.Generator().manual_seed(2)
    values = torch.randint(0, 16, (100, 128), generator=gen, dtype=torch.uint8)
    weight = QuantWeight(4, 32, pack_values(values, 4), torch.rand(100, 4, generator=gen),
                         torch.randn(100, 4, generator=gen))
    packed = quant_linear.pack(weight)
    x, bias = torch.randn(rows, 128, generator=gen), torch.randn(100, generator=gen)
    perm, q, so, so_bits = packed.args
    outs = []
    for fn in (native._library().pagedserve_quant_linear, ctypes_lib.pagedserve_quant_linear):
        out = torch.empty(rows, 100)
        assert fn(out.data_ptr(), x.data_ptr(), 128, perm, q, so, bias.data_ptr(), so_bits, 4, 32,
                  rows, 100, 128, 2) == 0
        outs.append(out)
    assert torch.equal(*outs)
    assert torch.equal(outs[0], quant_linear.linear(x, packed, bias))


def test_bad_calls_raise_type_errors_naming_the_kernel():
    lib = native._library()
    with pytest.raises(TypeError, match="pagedserve_silu_and_mul takes 6 arguments, got 2"):
        lib.pagedserve_silu_and_mul(0, 0)
    with pytest.raises(TypeError, match="pagedserve_silu_and_mul argument 2 must be an int, got float"):
        lib.pagedserve_silu_and_mul(0, 0, 1.5, 4, 0, 1)
    with pytest.raises(TypeError, match="argument 0 must be an int or None, got str"):
        lib.pagedserve_silu_and_mul("out", 0, 1, 4, 0, 1)
    with pytest.raises(TypeError):
        lib.pagedserve_rms_norm(0, 0, 0, 0, 0, "eps", 0, 1)
    with pytest.raises(TypeError, match="takes no arguments"):
        lib.pagedserve_linear_panel(1)
    with pytest.raises(OverflowError):
        lib.pagedserve_silu_and_mul(0, 0, 1 << 70, 4, 0, 1)
    # Zero rows write nothing: NULL pointers are fine.
    assert lib.pagedserve_silu_and_mul(None, None, 0, 4, 0, 1) == 0


def _run(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_ctypes_setting_keeps_ctypes():
    code = "import torch\nfrom pagedserve.kernels import native\nassert native.available()\nprint(native.calls())"
    assert _run(code, PAGEDSERVE_NATIVE_CALLS="ctypes") == "ctypes"


def test_without_the_headers_the_library_builds_for_ctypes(tmp_path):
    # A fresh cache and an include directory without Python.h: the build leaves the entry points
    # out, and every kernel still runs, through ctypes.
    code = ("import torch\nfrom pathlib import Path\nfrom pagedserve.kernels import native, native_norm_act\n"
            f"native.PYTHON_INCLUDE = Path({str(tmp_path / 'include')!r})\n"
            "assert native.available()\n"
            "assert not hasattr(native._lib, 'PyInit_pagedserve_cpu')\n"
            "out, x = torch.empty(2, 8), torch.randn(2, 16)\nnative_norm_act.silu_and_mul(out, x)\n"
            "assert torch.allclose(out, torch.nn.functional.silu(x[:, :8]) * x[:, 8:])\n"
            "print(native.calls())")
    assert _run(code, PAGEDSERVE_CACHE=str(tmp_path / "cache")) == "ctypes"


def test_entry_points_that_do_not_import_leave_ctypes(monkeypatch, caplog):
    def broken(spec):
        raise ImportError("undefined symbol: PyFake")

    monkeypatch.setattr(importlib.util, "module_from_spec", broken)
    lib = native._load(native.library_path())
    assert native.calls(lib) == "ctypes" and "undefined symbol: PyFake" in caplog.text
    assert lib.pagedserve_linear_panel() == native._library().pagedserve_linear_panel()


def test_fp32_and_bf16_gemms_agree(monkeypatch, ctypes_lib):
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(70, 48, generator=gen), torch.randn(9, 48, generator=gen)
    bias, offsets = torch.randn(70, generator=gen), torch.tensor([0, 4, 4, 9])
    packed = native_linear.pack_linear_weight(weight)
    experts = torch.stack([packed, packed * 0.5, -packed])
    bf16 = native_linear.linear_bf16_panel() > 0
    packed_bf16 = native_linear.pack_linear_weight_bf16(weight) if bf16 else None

    def run(lib):
        # The fp32 GEMMs find their library by panel width, the bf16 one is the loaded library's.
        monkeypatch.setitem(native_linear._library_by_panel, packed.shape[-1], lib)
        monkeypatch.setattr(native, "_lib", lib)
        try:
            outs = [native_linear.linear(x, packed, 70, bias),
                    native_linear.grouped_linear(x, experts, offsets, 70)]
            if bf16:
                outs += [native_linear.linear_bf16(x.bfloat16(), packed_bf16, 70, bias),
                         native_linear.linear_bf16(x, packed_bf16, 70, widen=True)]
            return outs
        finally:
            monkeypatch.undo()

    assert native.calls() == "python"
    for a, b in zip(run(native._library()), run(ctypes_lib)):
        assert torch.equal(a, b)
