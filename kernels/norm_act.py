"""RMSNorm (optionally fused with the residual add) and SiLU-and-mul: the torch formulas are the
spec, the native CPU kernels (kernels/native.py) run them in one pass for float32 and bfloat16 on
CPU (fp32 arithmetic inside, bf16 rounded where the formula rounds it), on every CPU level.

A decoder layer spends ~10 small torch ops per token row on these (each a pass over memory plus
dispatch overhead; in bf16 each also converts to fp32 and back); one native call each is what
vLLM's fused_add_rms_norm / silu_and_mul do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import native, native_norm_act

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native(x: torch.Tensor) -> bool:
    return x.dtype in _NATIVE_DTYPES and x.is_cpu and x.is_contiguous() and native.available()


def _native_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_native(x) and native_norm_act.norm_dtypes(x.dtype, weight.dtype) is not None
            and weight.is_contiguous())


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalises in float32 and scales in the input dtype, like the HF Llama reference."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """rms_norm(x) -> y; with residual: (rms_norm(x + residual), x + residual).

    The fused form may reuse x's and residual's storage for its two results.
    """
    if residual is None:
        if _native_norm(x, weight):
            out = torch.empty_like(x)
            native_norm_act.rms_norm(out, x, weight, eps)
            return out
        return rms_norm_reference(x, weight, eps)
    if _native_norm(x, weight) and _native(residual) and residual.dtype == x.dtype:
        native_norm_act.fused_add_rms_norm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] = [gate | up] -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] = [gate | up] -> silu(gate) * up."""
    if _native(x):
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype)
        native_norm_act.silu_and_mul(out, x)
        return out
    return silu_and_mul_reference(x)
