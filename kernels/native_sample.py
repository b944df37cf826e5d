"""The random sampler's draw in the native library (csrc/sample.c): one token per row from
softmax(logits * scale) by inverse CDF at a uniform the caller draws, as pagedserve.kernels.reference.sample_rows."""
from __future__ import annotations

import torch

from pagedserve.kernels.native import BF16_DATA, _check, _level_library
# The logits it reads are the greedy argmax's (else pagedserve.kernels.reference.sample_rows draws).
from pagedserve.kernels.native_argmax import usable


def sample_rows(logits: torch.Tensor, uniforms: torch.Tensor, scales: torch.Tensor | None = None,
                level: str | None = None) -> torch.Tensor:
    """logits [rows, n] float32 or bfloat16 on CPU (rows may be strided), uniforms float64 [rows]
    in [0, 1), scales float32 [rows] or None -> int64 [rows]."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if not (usable(logits) and uniforms.dtype is torch.float64 and uniforms.shape == (rows,)
            and uniforms.is_contiguous() and uniforms.is_cpu
            and (scales is None or (scales.dtype is torch.float32 and scales.shape == (rows,)
                                    and scales.is_contiguous() and scales.is_cpu))):
        raise ValueError(f"logits must be a 2-D float32 or bfloat16 CPU tensor with contiguous rows of "
                         f"at least one value, with float64 uniforms and float32 scales (or None) of "
                         f"one per row; got logits {logits.dtype} {list(logits.shape)} on "
                         f"{logits.device}, uniforms {uniforms.dtype} {list(uniforms.shape)}, scales "
                         f"{None if scales is None else (scales.dtype, list(scales.shape))}")
    out = torch.empty(rows, dtype=torch.int64)
    _check(_level_library(level).pagedserve_sample_rows(
        out.data_ptr(), logits.data_ptr(), uniforms.data_ptr(),
        None if scales is None else scales.data_ptr(), rows, logits.shape[1], logits.stride(0),
        BF16_DATA if logits.dtype is torch.bfloat16 else 0, torch.get_num_threads()))
    return out
