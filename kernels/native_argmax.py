"""The greedy sampler's argmax over a step's logits in the native library (csrc/argmax.c): the
first index of each row's largest value, NaN above everything, as torch.argmax(dim=-1)."""
from __future__ import annotations

import torch

from pagedserve.kernels import native
from pagedserve.kernels.native import BF16_DATA, _check, _level_library


def usable(logits: torch.Tensor) -> bool:
    """Whether argmax_rows takes these logits (else torch.argmax does)."""
    return (logits.dim() == 2 and logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.shape[1] > 0 and logits.stride(1) == 1 and native.available())


def argmax_rows(logits: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """logits [rows, n] float32 or bfloat16 on CPU, rows may be strided -> int64 [rows]."""
    if not usable(logits):
        raise ValueError(f"logits must be a 2-D float32 or bfloat16 CPU tensor with contiguous rows "
                         f"of at least one value, got {logits.dtype} {list(logits.shape)} on "
                         f"{logits.device}")
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    _check(_level_library(level).pagedserve_argmax_rows(
        out.data_ptr(), logits.data_ptr(), rows, n, logits.stride(0),
        BF16_DATA if logits.dtype is torch.bfloat16 else 0, torch.get_num_threads()))
    return out
