"""Linear layers on CPU, on a weight packed once at load time.

MKL (torch's default) runs the skinny GEMMs of decode steps at a fraction of the FMA peak and
barely uses a second thread; oneDNN on a prepacked weight is better; our register-blocked panel
kernel (csrc/gemm.c, panels packed for the level native.cpu_level() picked) is at least as fast
at every size, so with it the projection keeps only its packed weight (bench/cpu_ops.py compares
the three). Where it cannot run (no AVX2/FMA, no compiler) oneDNN's packing is used for
2-383 rows and MKL otherwise (both layouts kept).

bf16 weights, on a CPU level with AVX512-BF16 (csrc/gemm_bf16.c, native_linear.bf16_tile()), go
to the native kernel only, which keeps only its packed copy: where vdpbf16ps issues slower than
FMAs, widening the panels to fp32 in registers beats it and oneDNN (which uses it too). Without
AVX512-BF16, bf16 weights take oneDNN's packing where it accepts them (AVX-512), else F.linear.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_features, native, native_linear

logger = logging.getLogger(__name__)

# Without the native kernel: rows from which MKL beats oneDNN's packed kernel again (the crossover
# bench/cpu_ops.py finds), and one row on one thread, where MKL's GEMV is ahead.
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
