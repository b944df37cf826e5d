"""Linear layers on CPU: oneDNN with a weight packed once at load time, MKL for large batches.

Why (measured on a 2-core AVX2 EPYC, fp32): torch's default `F.linear` goes to MKL, which runs the
skinny GEMMs of a decode step (2-64 rows) at 15-50 GFLOP/s on one thread and barely uses a second
one; oneDNN on a prepacked weight runs them at 30-70 GFLOP/s on one thread and 85-155 on two (the
49152-wide lm_head gains most; a whole SmolLM2 step at 4 rows: 58 ms vs 104). MKL stays for one
row on one thread (its GEMV is ~8 % ahead there, but single-threaded: on two threads oneDNN is 25 %
ahead) and from a few hundred rows on (prefill chunks, 5-15 % ahead), so both layouts are kept: on
CPU the weights take twice the memory.

bf16 packing needs AVX-512 (or AVX-NE-CONVERT); where oneDNN refuses a weight it stays unpacked.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Rows from which MKL's sgemm beats the packed oneDNN kernel again (crossover measured at 256-512).
MKL_MIN_ROWS = 384


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """[out, in] weight -> oneDNN's packed copy of it, or None where it does not apply."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
    except RuntimeError as e:  # e.g. bf16 without AVX-512: F.linear it is
        logger.debug("oneDNN packing refused for %s weight: %s", weight.dtype, e)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x, through the packed weight when it is faster."""
    rows = x.shape[0]
    if packed is None or rows >= MKL_MIN_ROWS or (rows == 1 and torch.get_num_threads() == 1):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
