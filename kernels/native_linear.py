"""The packed-panel GEMMs of kernels/csrc (gemm.c: fp32; gemm_bf16.c: bf16 weights on
AVX512-BF16), through the library kernels/native.py loads.

A packed layout belongs to the kernel that packed it: its panel width is the level's
(pagedserve_linear_panel(): 16 for AVX2, 48 for AVX-512), so pack_linear_weight packs for a level
and linear() picks the kernel by the width of the panels it gets.
"""
from __future__ import annotations

import functools
import logging
import os
import time

import torch

from pagedserve.kernels import native
from pagedserve.kernels.native import _STATUS, _check, _explain, _fits

log = logging.getLogger(__name__)

_BF16 = torch.bfloat16
# Bits of the bf16 kernel's `dtypes` argument (csrc/gemm_bf16.c): which of out, x, bias are bf16.
_BF16_OUT, _BF16_X, _BF16_BIAS, _BF16_WIDEN = 1, 2, 4, 8
_library_by_panel: dict[int, object] = {}  # panel width -> the library whose GEMMs use it


@functools.cache
def linear_available() -> bool:
    """Whether the fp32 packed-panel GEMM runs here (x86-64 with AVX2 and FMA, or AVX-512)."""
    return native.available() and bool(native._library().pagedserve_linear_panel())


@functools.cache
def linear_bf16_available() -> bool:
    """Whether the bf16 GEMM runs here: the loaded level has AVX512-BF16."""
    return native.available() and bool(native._library().pagedserve_linear_bf16_panel())


def _lib(level: str | None):
    return native._library() if level is None else native.library(level)


def linear_panel(level: str | None = None) -> int:
    """Columns per packed fp32 weight panel for level's GEMM (default: the loaded level); 0 if none."""
    return _lib(level).pagedserve_linear_panel()


def pack_linear_weight(weight: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """[n, k] float32 weight -> [ceil(n / panel), k, panel] panels, zero-padded, for linear(),
    panel being linear_panel(level): the packed layout belongs to the level that packed it."""
    if not _fits(weight):
        _explain(weight=weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {list(weight.shape)}")
    lib = _lib(level)
    panel = lib.pagedserve_linear_panel()
    if not panel:
        raise RuntimeError(_STATUS[5][1])
    _library_by_panel.setdefault(panel, lib)
    n, k = weight.shape
    padded = torch.zeros((n + panel - 1) // panel * panel, k)
    padded[:n] = weight
    return padded.view(-1, panel, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [rows, k] (rows may be strided) . W^T (+ bias) -> [rows, n], W packed by
    pack_linear_weight; runs the GEMM of the level whose panel width the packing has."""
    lib = _library_by_panel.get(packed.shape[-1]) if packed.dim() == 3 else None
    if not (x.dtype is torch.float32 and x.is_cpu and _fits(packed)):
        _explain(x=x.contiguous(), packed=packed)
    if x.dim() != 2 or lib is None or packed.shape[1] != x.shape[1] or packed.shape[0] * packed.shape[2] < n:
        raise ValueError(f"x {list(x.shape)} does not fit packed weight {list(packed.shape)} with n={n}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        if not _fits(bias):
            _explain(bias=bias)
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape [{n}], got {list(bias.shape)}")
    rows, k = x.shape
    out = torch.empty(rows, n)
    _check(lib.pagedserve_linear(out.data_ptr(), x.data_ptr(), x.stride(0), packed.data_ptr(),
                                 None if bias is None else bias.data_ptr(), rows, n, k, torch.get_num_threads()))
    return out


def grouped_linear(x: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Rows offsets[g]:offsets[g + 1] of x [rows, k] through weight g -> [rows, n]: packed is
    [groups, panels, k, panel], each group packed by pack_linear_weight (torch.stack of them);
    offsets int64 [groups + 1], from 0, non-decreasing, ending at rows (a mixture of experts'
    tokens sorted by expert). One native call for every expert of a layer."""
    groups = packed.shape[0] if packed.dim() == 4 else 0
    lib = _library_by_panel.get(packed.shape[-1]) if groups else None
    if not (x.dtype is torch.float32 and x.is_cpu and _fits(packed)):
        _explain(x=x.contiguous(), packed=packed)
    if (x.dim() != 2 or lib is None or packed.shape[2] != x.shape[1] or packed.shape[1] * packed.shape[3] < n
            or offsets.dtype is not torch.int64 or not offsets.is_contiguous() or offsets.shape != (groups + 1,)):
        raise ValueError(f"x {list(x.shape)} and offsets {offsets.dtype} {list(offsets.shape)} do not fit "
                         f"grouped packed weights {list(packed.shape)} with n={n}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    if int(offsets[-1]) != rows:
        raise ValueError(f"offsets end at {int(offsets[-1])}, x has {rows} rows")
    out = torch.empty(rows, n)
    _check(lib.pagedserve_grouped_linear(
        out.data_ptr(), x.data_ptr(), x.stride(0), packed.data_ptr(), offsets.data_ptr(), groups, n, k,
        torch.get_num_threads()))
    return out


@functools.cache
def linear_bf16_panel() -> int:
    """Columns per packed bf16 weight panel (0 where the loaded level has no bf16 GEMM)."""
    return native._library().pagedserve_linear_bf16_panel()


def pack_linear_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] weight (bf16, or fp32 rounded to bf16) -> bf16 [ceil(n / panel), ceil(k / 2), panel, 2]:
    each column's k values in pairs, zero-padded in n and k, for linear_bf16()."""
    if weight.dim() != 2 or not weight.is_cpu or weight.dtype not in (_BF16, torch.float32):
        raise ValueError(f"weight must be a 2-D [out, in] bf16 or float32 CPU tensor, got "
                         f"{weight.dtype} {list(weight.shape)} on {weight.device}")
    panel = linear_bf16_panel()
    if not panel:
        raise RuntimeError(_STATUS[5][1])
    n, k = weight.shape
    pairs = (k + 1) // 2
    padded = torch.zeros((n + panel - 1) // panel * panel, 2 * pairs, dtype=_BF16)
    padded[:n, :k] = weight
    return padded.view(-1, panel, pairs, 2).transpose(1, 2).contiguous()


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                widen: bool = False) -> torch.Tensor:
    """x [rows, k] bf16 or fp32 (rows may be strided) . W^T (+ bias) -> [rows, n] in x's dtype,
    W packed by pack_linear_weight_bf16; products add up in fp32 and the sum (plus bias, bf16 or
    fp32) is rounded once. widen=False: vdpbf16ps, x rounded to bf16 (torch's bf16 F.linear, to
    float rounding); widen=True: the weight widened to fp32 in registers, fp32 FMAs, x as it is
    (for a bf16 x the two agree to float rounding)."""
    lib = native._lib or native._library()
    if not (x.dtype in (_BF16, torch.float32) and x.is_cpu and x.dim() == 2 and packed.dtype is _BF16
            and packed.is_contiguous() and packed.dim() == 4 and packed.shape[2:] == (linear_bf16_panel(), 2)
            and packed.shape[1] == (x.shape[1] + 1) // 2 and packed.shape[0] * packed.shape[2] >= n):
        raise ValueError(f"x {x.dtype} {list(x.shape)} does not fit packed bf16 weight "
                         f"{packed.dtype} {list(packed.shape)} with n={n}")
    if x.stride(1) != 1:
        x = x.contiguous()
    dtypes = ((_BF16_OUT | _BF16_X) if x.dtype is _BF16 else 0) | (_BF16_WIDEN if widen else 0)
    if bias is not None:
        if bias.shape != (n,) or bias.dtype not in (_BF16, torch.float32) or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous bf16 or float32 [{n}], got {bias.dtype} "
                             f"{list(bias.shape)}")
        dtypes |= _BF16_BIAS if bias.dtype is _BF16 else 0
    rows, k = x.shape
    out = torch.empty(rows, n, dtype=x.dtype)
    _check(lib.pagedserve_linear_bf16(out.data_ptr(), x.data_ptr(), x.stride(0), packed.data_ptr(),
                                      None if bias is None else bias.data_ptr(), dtypes, rows, n, k,
                                      torch.get_num_threads()))
    return out


BF16_TILE_ENV = "PAGEDSERVE_BF16_TILE"
BF16_TILES = ("dot", "widen")


@functools.cache
def bf16_tile() -> str:
    """The bf16 tile this process runs: "dot" (vdpbf16ps) or "widen" (fp32 FMAs on the widened
    weight), PAGEDSERVE_BF16_TILE if set, else whichever is faster on this CPU at a compute-bound
    size (64 rows), timed once. How fast vdpbf16ps issues against FMAs differs between CPUs, and
    one choice per process keeps a row's result independent of the batch it runs in. Both read
    the same packed weight."""
    forced = os.environ.get(BF16_TILE_ENV, "").strip().lower()
    if forced in BF16_TILES:
        return forced
    if forced:
        log.warning("ignoring %s=%s: not one of %s", BF16_TILE_ENV, forced, ", ".join(BF16_TILES))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 576, generator=gen).bfloat16()
    x = torch.randn(64, 576, generator=gen).bfloat16()
    packed = pack_linear_weight_bf16(weight)
    best = {tile: float("inf") for tile in BF16_TILES}
    for _ in range(5):  # alternating, best of each: load from other processes falls on both
        for tile in BF16_TILES:
            start = time.perf_counter()
            linear_bf16(x, packed, 576, widen=tile == "widen")
            best[tile] = min(best[tile], time.perf_counter() - start)
    # dot only where clearly faster: widen also keeps fp32 activations unrounded.
    choice = "dot" if best["dot"] < 0.9 * best["widen"] else "widen"
    log.info("bf16 GEMM tile: %s (64 x 576 x 576: dot %.0f us, widen %.0f us)", choice,
             best["dot"] * 1e6, best["widen"] * 1e6)
    return choice
