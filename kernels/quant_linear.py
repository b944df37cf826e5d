"""Weight-only quantized linear layers on CPU: a kernels.quantized.QuantWeight packed once at load
into the layout of csrc/gemm_q.h, then x . W^T computed in float32 with W dequantized in registers
(kernels.reference.quant_linear is the spec).

Panels are as wide as the fp32 GEMM's at the same CPU level (48 columns on AVX-512, 16 on AVX2),
so a packed layout belongs to the level that packed it and linear() picks the kernel by the panel
width it gets (as kernels/native_linear.py does). Where the native kernel cannot run (no AVX2 and
FMA, no compiler) pack() dequantizes to float32 once and the projection runs on
kernels.cpu_linear's paths: everything works, without the bytes saved.

Measured with bench/quant_gemm.py on a 2-core AVX-512 Xeon (Sapphire Rapids class, avx512_bf16
level), the 30 layers + lm_head of SmolLM2-135M per step, each layer its own weights, 1 thread,
medians of alternating runs (the machine was shared: load average ~8):

    rows                      1       4      16      64
    fp32 native GEMM        51 ms   59     124     270
    int4 g32 (+ int8 head)  14      19      62     255     (the model as it ships, GGUF Q4_1)
    int8 g32                20      22      76     261

One int4 step reads 110 MiB (scales and offsets included, the lm_head int8) against fp32's 513 MiB:
4.7x fewer bytes, 3.6x / 3.1x faster at 1 / 4 rows, and level (1.06x) at 64, where both are
compute bound and each quantized panel is dequantized once per call into a scratch panel in L2.
Two-thread figures on that shared machine were noise (other processes held the cores).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kernels import cpu_linear, native, reference
from kernels.native import _check
from kernels.quantized import QuantWeight

_F32, _BF16 = torch.float32, torch.bfloat16
# Bits of the kernel's `dtypes` argument (csrc/gemm_q.c): which of out, x, bias are bf16.
_BF16_OUT, _BF16_X, _BF16_BIAS = 1, 2, 4
_kernel_by_panel: dict[int, object] = {}  # panel width -> the pagedserve_quant_linear that packs it


class PackedQuant(NamedTuple):
    """A QuantWeight in a kernel's layout. kind "q4" / "q8": q uint8 [panels, k * bits / 8 *
    panel] and scale_offsets float32 [panels, k / group_size, 2, panel] (csrc/gemm_q.c); kind
    "dense": `dense` is the dequantized float32 weight's cpu_linear packing (None: F.linear on
    `weight`)."""
    kind: str  # "q4", "q8" or "dense"
    n: int  # out_features
    k: int  # in_features
    perm: torch.Tensor | None  # int64 [k], stored column -> input channel (act-order), or None
    bits: int
    group_size: int
    panel: int  # columns per packed panel (0 for "dense")
    q: torch.Tensor | None
    scale_offsets: torch.Tensor | None
    dense: cpu_linear.PackedWeight | None = None
    weight: torch.Tensor | None = None  # float32 [n, k], kept only where `dense` needs it

    @property
    def nbytes(self) -> int:
        """Bytes a call reads for the weight: what a decode step streams from memory."""
        tensors = [self.q, self.scale_offsets, self.perm, self.weight,
                   None if self.dense is None else self.dense.tensor]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@functools.cache
def available() -> bool:
    """Whether the native quantized GEMM runs here (the loaded CPU level has AVX2 + FMA or AVX-512)."""
    return native.available() and bool(native._library().pagedserve_quant_linear_panel())


def panel_width(level: str | None = None) -> int:
    """Columns per packed panel for level's kernel (default: the loaded level); 0 if it has none."""
    return native._level_library(level).pagedserve_quant_linear_panel()


def pack(weight: QuantWeight, level: str | None = None) -> PackedQuant:
    """weight -> its packed copy for the kernel of level (default: the loaded one); kind "dense"
    where no native kernel runs (level "dense" forces that, for tests)."""
    n, k = weight.shape
    perm = None if weight.perm is None else _checked_perm(weight.perm, k)
    if level == "dense" or (level is None and not available()):
        return _pack_dense(weight, perm)
    lib = native._level_library(level)
    panel = lib.pagedserve_quant_linear_panel()
    if not panel:
        return _pack_dense(weight, perm)
    _kernel_by_panel.setdefault(panel, lib.pagedserve_quant_linear)
    if weight.bits == 4 and weight.group_size % 2:  # a nibble pair would straddle two groups
        weight = weight.as_format(8, weight.group_size)
    bits, group_size = weight.bits, weight.group_size
    panels = (n + panel - 1) // panel
    pad = panels * panel - n
    # QuantWeight's 4-bit byte c of a row already holds values 2c and 2c + 1: transposing rows
    # into panels gives the kernel's layout; 8-bit is one byte per value likewise.
    q = torch.nn.functional.pad(weight.q, (0, 0, 0, pad))
    q = q.view(panels, panel, -1).transpose(1, 2).contiguous().view(panels, -1)
    so = torch.stack((weight.scales, weight.offsets), dim=1)  # [n, 2, groups]
    so = torch.nn.functional.pad(so, (0, 0, 0, 0, 0, pad))  # zero columns dequantize to 0
    so = so.view(panels, panel, 2, -1).permute(0, 3, 2, 1).contiguous()
    return PackedQuant(f"q{bits}", n, k, perm, bits, group_size, panel, q, so)


def _checked_perm(perm: torch.Tensor, k: int) -> torch.Tensor:
    perm = perm.to(torch.int64).contiguous()
    if perm.numel() and (int(perm.min()) < 0 or int(perm.max()) >= k):
        raise ValueError(f"perm must hold input channels in 0..{k - 1}")
    return perm


def _pack_dense(weight: QuantWeight, perm: torch.Tensor | None) -> PackedQuant:
    dense = reference.dequantize_weight(weight)
    packed = cpu_linear.pack(dense)
    n, k = weight.shape
    keep = None if packed is not None and packed.replaces_weight else dense
    return PackedQuant("dense", n, k, perm, weight.bits, weight.group_size, 0, None, None, packed, keep)


def linear(x: torch.Tensor, packed: PackedQuant, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] float32 or bfloat16 (rows may be strided) . W^T (+ bias) -> [rows, n] in x's
    dtype, W the packed QuantWeight's value (reference.quant_linear, to float rounding)."""
    n, k = packed.n, packed.k
    dtype = x.dtype
    if not (dtype is _F32 or dtype is _BF16) or not x.is_cpu or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be a float32 or bfloat16 CPU tensor [rows, {k}], got {dtype} "
                         f"{list(x.shape)} on {x.device}")
    if bias is not None and not (bias.shape == (n,) and (bias.dtype is _F32 or bias.dtype is _BF16)
                                 and bias.is_cpu and bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 or bfloat16 CPU tensor [{n}], got "
                         f"{bias.dtype} {list(bias.shape)}")
    if packed.kind == "dense":
        out = cpu_linear.linear(x.float(), packed.weight, packed.dense,
                                None if bias is None else bias.float())
        return out.to(dtype)
    kernel = _kernel_by_panel.get(packed.panel)
    if kernel is None:
        raise ValueError(f"no loaded kernel packs panels of {packed.panel} columns")
    if x.stride(1) != 1:
        x = x.contiguous()
    dtypes = (_BF16_OUT | _BF16_X if dtype is _BF16 else 0) | (
        _BF16_BIAS if bias is not None and bias.dtype is _BF16 else 0)
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=dtype)
    _check(kernel(out.data_ptr(), x.data_ptr(), x.stride(0),
                  None if packed.perm is None else packed.perm.data_ptr(), packed.q.data_ptr(),
                  packed.scale_offsets.data_ptr(), None if bias is None else bias.data_ptr(), dtypes,
                  packed.bits, packed.group_size, rows, n, k, torch.get_num_threads()))
    return out
