"""Linear layers on CPU, on a weight packed once at load time.

Measured on a 2-core AVX2 EPYC, fp32, the 30 layers + lm_head of SmolLM2-135M per step, 1 thread:

    rows          1      4      16     64     256    1024
    MKL         47 ms  101    144    303    912    3338
    oneDNN      47     61     102    271    885    3550   (weight prepacked)
    native      35     48      80    220    830    3179   (csrc/gemm.c, 16-column panels)

MKL (torch's default) runs the skinny GEMMs of decode steps at a fraction of the FMA peak and
barely uses a second thread; oneDNN on a prepacked weight is better; our register-blocked panel
kernel is best at every size, so with it the projection keeps only its packed weight.

On a 2-core AVX-512 Xeon (Sapphire/Emerald Rapids class), same step, 1 thread, the panels packed
for the CPU level native.cpu_level() picked (48 columns for AVX-512, 16 for AVX2):

    rows          1      4      16     64     256
    MKL         38 ms   77     98    181    522
    oneDNN      44      51     70    148    487   (weight prepacked, AVX-512)
    native AVX2 38      44     81    238    858
    native 512  36      41     58    146    486   (8 x 48 tile)

There the AVX-512 tile leads at 1-16 rows and ties oneDNN from 64 up (both near the FMA peak),
so the native path stays the only one. Where it cannot run (no AVX2/FMA, no compiler) oneDNN's
packing is used for 2-383 rows and MKL otherwise (both layouts kept).

bf16 weights, on a CPU level with AVX512-BF16 (csrc/gemm_bf16.c, native_linear.bf16_tile()):
measured on the same Xeon, one GEMM of 3072 x 576, 1 thread, GFLOP/s:

    rows             1      8     64    256
    oneDNN bf16     16     65     79     76   (weight prepacked; torch's bf16 F.linear)
    native dot      23     74     84     73   (vdpbf16ps)
    native widen    26    109    141    110   (bf16 panels widened to fp32 in registers)
    native fp32     13     80    118    146   (for scale: twice the weight bytes)

vdpbf16ps issues at a quarter of the FMA rate on this Xeon, so oneDNN (which uses it too, there
being no AMX here) and our dot tile lose to the widening tile at every size: bf16 weights go to
the native kernel only, which keeps only its packed copy. Without AVX512-BF16, bf16 weights take
oneDNN's packing where it accepts them (AVX-512), else F.linear.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_features, native, native_linear

logger = logging.getLogger(__name__)

# Without the native kernel: rows from which MKL beats oneDNN's packed kernel again (crossover
# measured at 256-512), and one row on one thread, where MKL's GEMV is ~8 % ahead.
MKL_MIN_ROWS = 384


class PackedWeight(NamedTuple):
    kind: str  # "native" (csrc/gemm.c panels), "native_bf16" (csrc/gemm_bf16.c pairs) or "onednn"
    tensor: torch.Tensor
    out_features: int

    @property
    def replaces_weight(self) -> bool:
        """Whether every call goes through the packed copy, so the plain weight can be freed."""
        return self.kind in ("native", "native_bf16")


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """[out, in] weight -> its packed copy for the fastest kernel here, or None (F.linear)."""
    if weight.device.type != "cpu":
        return None
    weight = weight.detach()
    if weight.dtype == torch.float32 and native_linear.linear_available():
        return PackedWeight("native", native_linear.pack_linear_weight(weight), weight.shape[0])
    if weight.dtype == torch.bfloat16 and native_linear.linear_bf16_available():
        native_linear.bf16_tile()  # timed once, at load rather than inside the first step
        return PackedWeight("native_bf16", native_linear.pack_linear_weight_bf16(weight), weight.shape[0])
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(weight, 64), weight.shape[0])
    except RuntimeError as e:  # e.g. bf16 without AVX-512
        logger.debug("oneDNN packing refused for %s weight: %s", weight.dtype, e)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.kind == "native":
        return native_linear.linear(x, packed.tensor, packed.out_features, bias)
    if packed.kind == "native_bf16":
        return native_linear.linear_bf16(x, packed.tensor, packed.out_features, bias,
                                         widen=native_linear.bf16_tile() == "widen")
    rows = x.shape[0]
    if rows >= MKL_MIN_ROWS or (rows == 1 and torch.get_num_threads() == 1):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")


def describe(dtype: torch.dtype) -> dict:
    """The CPU and the kernels a model of this dtype gets here, for stats and benchmark records."""
    info = {**cpu_features.describe(), "native_level": native.cpu_level() if native.available() else None}
    if dtype == torch.bfloat16:
        info["bf16_gemm"] = (f"native_{native_linear.bf16_tile()}" if native_linear.linear_bf16_available()
                             else "onednn" if torch.backends.mkldnn.is_available() else "torch")
    return info
