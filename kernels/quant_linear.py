"""Weight-only quantized linear layers on CPU: a pagedserve.kernels.quantized.QuantWeight packed once at load
into the layout of csrc/gemm_q.h, then x . W^T computed in float32 with W dequantized in registers
(pagedserve.kernels.reference.quant_linear is the spec).

Panels are as wide as the fp32 GEMM's at the same CPU level (48 columns on AVX-512, 16 on AVX2),
so a packed layout belongs to the level that packed it, and the packing keeps that level's kernel
(two levels can share a panel width and differ in code). Where the native kernel cannot run (no
AVX2 and FMA, no compiler) pack() dequantizes to float32 once and the projection runs on
pagedserve.kernels.cpu_linear's paths: everything works, without the bytes saved.

Decode is bound by the bytes of its weights, and an int4 step reads a fraction of fp32's, so the
quantized kernel is faster at decode's few rows; at prefill's many rows both are compute bound
and each quantized panel is dequantized once per call into a scratch panel in L2, so they run
level (bench/quant_gemm.py measures both against the fp32 GEMM).

Scales and offsets that are IEEE halves (GGUF's always are) pack as halves: 0.625 bytes a 4-bit
value instead of 0.75, lossless. PAGEDSERVE_QUANT_ACTIVATIONS=int8 (off by default) packs for
csrc/gemm_q_i8.c instead, on AVX512-VNNI CPUs: activations rounded to int8 per block of 32, integer
dot products (llama.cpp's scheme). It is faster per call but not token-exact: greedy outputs part
from the float path's within a few tokens, hence off by default.

bf16 rows past decode's few, on AVX512-BF16 (csrc/gemm_q.c's Q_PAIRS): the dequantized panel is
rounded to bf16 pairs and multiplied on vdpbf16ps, faster than the fp32 scratch panel there
(bench/quant_gemm.py --dtype bfloat16). Decode's bf16 rows (up to csrc/gemm_q.h's
Q_DIRECT_PAIR_ROWS) widen the packed integers to bf16 pairs in registers instead, exactly, and
multiply on vdpbf16ps too (csrc/gemm_q_direct.c).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from pagedserve.kernels import cpu_linear, native, reference
from pagedserve.kernels.native import _check
from pagedserve.kernels.quantized import QuantWeight

_F32, _BF16 = torch.float32, torch.bfloat16
# Bits of the kernel's `dtypes` argument (csrc/gemm_q.h): which of out, x, bias are bf16, and
# whether the scales and offsets are halves.
_BF16_OUT, _BF16_X, _BF16_BIAS, _F16_SO = 1, 2, 4, 8
_i8_panels: dict[str, int] = {}  # level -> its int8-activation kernel's panel width (0: none)
# The activations of the native kernels: "float32" (the spec's arithmetic, the default) or "int8"
# (csrc/gemm_q_i8.c, llama.cpp's scheme: faster, activations rounded per block of 32, so greedy
# tokens can differ from the float path's; see int8_activation_reference).
ACTIVATIONS = ("float32", "int8")
ACTIVATIONS_ENV = "PAGEDSERVE_QUANT_ACTIVATIONS"
I8_BLOCK = 32  # activations quantized per this many input channels (csrc/gemm_q_i8.c's Q8_BLOCK)


class PackedQuant(NamedTuple):
    """A QuantWeight in a kernel's layout. kind "q4" / "q8": q uint8 [panels, k * bits / 8 *
    panel] and scale_offsets [panels, k / group_size, 2, panel] (csrc/gemm_q.h; kinds "w4a8" /
    "w8a8" csrc/gemm_q_i8.c's layout), float16 where that is lossless, else float32; kind
    "dense": `dense` is the dequantized float32 weight's cpu_linear packing (None: F.linear on
    `weight`)."""
    kind: str  # "q4", "q8", "w4a8" / "w8a8" (int8 activations, csrc/gemm_q_i8.c) or "dense"
    n: int  # out_features
    k: int  # in_features
    perm: torch.Tensor | None  # int64 [k], stored column -> input channel (act-order), or None
    bits: int
    group_size: int
    panel: int  # columns per packed panel (0 for "dense")
    q: torch.Tensor | None
    scale_offsets: torch.Tensor | None  # float16 where lossless, else float32
    dense: cpu_linear.PackedWeight | None = None
    weight: torch.Tensor | None = None  # float32 [n, k], kept only where `dense` needs it
    args: tuple = ()  # the kernel's weight arguments (pointers, so's dtype), read once at pack
    # The packing level's own function: levels that share a panel width differ in their code
    # (AVX512-BF16 multiplies bf16 rows on vdpbf16ps, csrc/gemm_q.c's Q_PAIRS).
    kernel: object = None

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


def activations_setting() -> str:
    """The activations new packings use: $PAGEDSERVE_QUANT_ACTIVATIONS, else "float32"."""
    value = os.environ.get(ACTIVATIONS_ENV, "").strip().lower() or "float32"
    if value not in ACTIVATIONS:
        raise ValueError(f"{ACTIVATIONS_ENV}={value!r}: supported are {', '.join(ACTIVATIONS)}")
    return value


def pack(weight: QuantWeight, level: str | None = None, activations: str | None = None) -> PackedQuant:
    """weight -> its packed copy for the kernel of level (default: the loaded one); kind "dense"
    where no native kernel runs (level "dense" forces that, for tests). activations "int8"
    (default: activations_setting()) takes the int8-activation kernel where this CPU has it
    (AVX512-VNNI) and the weight's groups are whole blocks of I8_BLOCK; else the float32 one."""
    n, k = weight.shape
    perm = None if weight.perm is None else _checked_perm(weight.perm, k)
    if level == "dense" or (level is None and not available()):
        return _pack_dense(weight, perm)
    lib = native._level_library(level)
    if (activations or activations_setting()) == "int8" and weight.group_size % I8_BLOCK == 0:
        panel = _i8_kernel(level, lib)
        if panel:
            return _pack_i8(weight, perm, panel, lib.pagedserve_quant_linear_i8)
    panel = lib.pagedserve_quant_linear_panel()
    if not panel:
        return _pack_dense(weight, perm)
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
    so = _halves_if_lossless(so.view(panels, panel, 2, -1).permute(0, 3, 2, 1).contiguous())
    args = (None if perm is None else perm.data_ptr(), q.data_ptr(), so.data_ptr(),
            _F16_SO if so.dtype is torch.float16 else 0)
    return PackedQuant(f"q{bits}", n, k, perm, bits, group_size, panel, q, so, args=args,
                       kernel=lib.pagedserve_quant_linear)


def _i8_kernel(level: str | None, lib) -> int:
    """The panel width of level's pagedserve_quant_linear_i8 (csrc/gemm_q_i8.c), 0 where it cannot
    run (no AVX-512 level, or no VNNI)."""
    key = level or native.cpu_level()
    if key not in _i8_panels:
        _i8_panels[key] = lib.pagedserve_quant_linear_i8_panel()
    return _i8_panels[key]


def _pack_i8(weight: QuantWeight, perm: torch.Tensor | None, panel: int, kernel) -> PackedQuant:
    """The layout of csrc/gemm_q_i8.c: per panel, 4 vectors of 16 columns x 4 bytes of k."""
    n, k = weight.shape
    bits, group_size = weight.bits, weight.group_size
    panels = (n + panel - 1) // panel
    pad = panels * panel - n
    values = torch.nn.functional.pad(weight.values(), (0, 0, 0, pad))  # [n_pad, k]
    lanes = panel // 4  # columns per vector
    if bits == 4:  # [p, v, l, c, h, j] -> [p, c, v, l, j, h]; nibble h = 0 low, 1 high
        v = values.view(panels, 4, lanes, k // 8, 2, 4).permute(0, 3, 1, 2, 5, 4)
        q = (v[..., 0] | (v[..., 1] << 4)).contiguous().view(panels, -1)
    else:  # [p, v, l, c, j] -> [p, c, v, l, j]
        q = values.view(panels, 4, lanes, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous().view(panels, -1)
    so = torch.stack((weight.scales, weight.offsets), dim=1)
    so = torch.nn.functional.pad(so, (0, 0, 0, 0, 0, pad))
    so = _halves_if_lossless(so.view(panels, panel, 2, -1).permute(0, 3, 2, 1).contiguous())
    args = (q.data_ptr(), so.data_ptr(), int(so.dtype is torch.float16))
    return PackedQuant(f"w{bits}a8", n, k, perm, bits, group_size, panel, q, so, args=args, kernel=kernel)


def int8_activation_reference(x: torch.Tensor, weight: QuantWeight,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The spec of the int8-activation kernel: x [rows, k] rounded per block of I8_BLOCK input
    channels (in stored-column order) to dx * qx, qx = round(x * (127 / amax)), dx = amax / 127,
    then W's scale term taken against that and its offset term against the exact x, in float64."""
    n, k = weight.shape
    xf = x.float() if weight.perm is None else x.float()[:, weight.perm]
    blocks = xf.view(-1, k // I8_BLOCK, I8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    iscale = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = (blocks * iscale).round()
    dx = amax / 127.0
    repeat = weight.group_size // I8_BLOCK
    scales = weight.scales.double().repeat_interleave(repeat, 1)  # [n, blocks]
    offsets = weight.offsets.double().repeat_interleave(repeat, 1)
    values = weight.values().double().view(n, k // I8_BLOCK, I8_BLOCK)
    dots = torch.einsum("rbi,nbi->rnb", qx.double(), values)  # exact integers
    out = torch.einsum("rnb,nb,rb->rn", dots, scales, dx.double().squeeze(-1))
    out = out + blocks.double().sum(-1) @ offsets.T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def _halves_if_lossless(so: torch.Tensor) -> torch.Tensor:
    """Scales and offsets as IEEE halves where that loses nothing (GGUF stores them so): a decode
    step is bound by the bytes it streams, and at 4 bits their floats are a third of those."""
    half = so.half()
    return half if torch.equal(half.float(), so) else so


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
    kind = packed.kind
    if kind == "dense":
        out = cpu_linear.linear(x.float(), packed.weight, packed.dense,
                                None if bias is None else bias.float())
        return out.to(dtype)
    if kind[0] == "w":
        return _linear_i8(x, packed, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    dtypes = (_BF16_OUT | _BF16_X if dtype is _BF16 else 0) | (
        _BF16_BIAS if bias is not None and bias.dtype is _BF16 else 0)
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=dtype)
    perm, q, so, so_bits = packed.args
    _check(packed.kernel(out.data_ptr(), x.data_ptr(), x.stride(0), perm, q, so,
                  None if bias is None else bias.data_ptr(), dtypes | so_bits, packed.bits,
                  packed.group_size, rows, n, k, torch.get_num_threads()))
    return out


def _linear_i8(x: torch.Tensor, packed: PackedQuant, bias: torch.Tensor | None) -> torch.Tensor:
    """linear() on the int8-activation kernel, which takes float32 rows in stored-column order."""
    dtype = x.dtype
    if packed.perm is not None:
        x = x[:, packed.perm]
    if dtype is not _F32 or x.stride(1) != 1:
        x = x.float().contiguous()
    if bias is not None and bias.dtype is not _F32:
        bias = bias.float()
    rows = x.shape[0]
    out = torch.empty(rows, packed.n, dtype=_F32)
    _check(packed.kernel(out.data_ptr(), x.data_ptr(), x.stride(0), *packed.args,
                         None if bias is None else bias.data_ptr(), packed.bits, packed.group_size,
                         rows, packed.n, packed.k, torch.get_num_threads()))
    return out if dtype is _F32 else out.to(dtype)
