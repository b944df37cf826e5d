"""The native norm, rotary and activation kernels' wrappers (csrc/norm_act.c, csrc/rotary_kv.c):
RMSNorm and its fused residual add, rotary embedding fused with the KV-cache store, SiLU-and-mul.
Each writes in place into tensors the caller made, in float32 or bfloat16, computing in fp32;
kernels/norm_act.py and kernels/rotary.py choose between them and the torch references."""
from __future__ import annotations

import torch

from pagedserve.kernels.native import (
    _BF16, _F32, BF16_DATA, BF16_KV, BF16_WEIGHT, _check, _explain_data, _fits_data,
    _level_library, available,
)


def norm_dtypes(data: torch.dtype, weight: torch.dtype) -> int | None:
    """The kernels' `dtypes` bits for these norm operand dtypes, None where no kernel takes them:
    data and weight both float32 or both bfloat16, or float32 data with a bfloat16 weight (which
    torch promotes to float32, as the kernel computes)."""
    if data is _F32:
        return 0 if weight is _F32 else BF16_WEIGHT if weight is _BF16 else None
    return BF16_DATA | BF16_WEIGHT if data is _BF16 and weight is _BF16 else None


def _norm_rows(x: torch.Tensor, weight: torch.Tensor, other: torch.Tensor, other_name: str
               ) -> tuple[int, int]:
    """(rows of x, dtypes) after checking x, weight and other (out or residual, x's twin)."""
    dtypes = norm_dtypes(x.dtype, weight.dtype)
    if dtypes is None or not (_fits_data(x, x.dtype) and _fits_data(other, x.dtype)
                              and _fits_data(weight, weight.dtype)):
        if dtypes is None:
            raise ValueError(f"x {x.dtype} and weight {weight.dtype}: expected both float32, both "
                             f"bfloat16, or float32 x with a bfloat16 weight")
        _explain_data(x.dtype, x=x, **{other_name: other})
        _explain_data(weight.dtype, weight=weight)
    hidden = weight.shape[0] if weight.dim() == 1 else -1
    shape = x.shape
    if not shape or shape[-1] != hidden or other.shape != shape:
        raise ValueError(f"expected x and {other_name} [..., hidden] of one shape and weight "
                         f"[hidden], got {list(shape)}, {list(other.shape)} and {list(weight.shape)}")
    return (x.numel() // hidden if hidden else 0), dtypes


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             level: str | None = None) -> None:
    """out = x * rsqrt(mean(x^2, -1) + eps) * weight, over x's last dimension (dtypes as in
    norm_dtypes; a bf16 row is normalised in fp32, rounded, then scaled, as the reference)."""
    lib = _level_library(level)
    rows, dtypes = _norm_rows(x, weight, out, "out")
    lib.pagedserve_rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows, weight.shape[0],
                            eps, dtypes, torch.get_num_threads())


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, *, level: str | None = None) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight (vLLM's semantics)."""
    lib = _level_library(level)
    rows, dtypes = _norm_rows(x, weight, residual, "residual")
    lib.pagedserve_fused_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), rows,
                                      weight.shape[0], eps, dtypes, torch.get_num_threads())


def takes_rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether rotary_store_kv runs these operands (else the caller runs the reference)."""
    dtype = qkv.dtype
    return ((dtype is _F32 or dtype is _BF16) and cos.dtype is dtype and sin.dtype is dtype
            and (kv_cache.dtype is _F32 or kv_cache.dtype is _BF16) and qkv.is_cpu
            and kv_cache.is_cpu and slot_mapping.dtype is torch.int64 and available())


def rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, *, level: str | None = None) -> None:
    """In place: q and k of qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] (rows may be
    strided) rotated by cos, sin [T, 1 or none, half] (the rotary table's rows for each token:
    the first 2 * half dims of each head rotate), then k and v stored in kv_cache [2, blocks,
    block_size, num_kv_heads, head_dim] at slot_mapping (int64 [T]). qkv, cos and sin share one
    dtype (float32 or bfloat16); the cache is either."""
    lib = _level_library(level)
    num_tokens = qkv.shape[0] if qkv.dim() == 2 else -1
    half = cos.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    cs_stride = cos.stride(0) if cos.dim() else 0
    if not (takes_rotary_store_kv(qkv, cos, sin, kv_cache, slot_mapping) and num_tokens >= 0
            and qkv.shape[1] == width and qkv.stride(1) == 1 and kv_cache.is_contiguous()
            and kv_cache.shape == (2, *kv_cache.shape[1:3], num_kv_heads, head_dim)
            and 2 * half <= head_dim and cos.shape == sin.shape and cos.shape[0] == num_tokens
            and cos.numel() == num_tokens * half and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and sin.stride(0) == cs_stride and slot_mapping.shape == (num_tokens,)
            and slot_mapping.is_contiguous()):
        raise ValueError(
            f"rotary_store_kv takes qkv [T, {width}] (rows of unit stride), cos and sin [T, .., "
            f"half] of its dtype, kv_cache [2, blocks, block_size, {num_kv_heads}, {head_dim}] "
            f"(contiguous, float32 or bfloat16) and int64 slot_mapping [T]; got qkv "
            f"{list(qkv.shape)} {qkv.dtype}, cos {list(cos.shape)} {cos.dtype}, kv_cache "
            f"{list(kv_cache.shape)} {kv_cache.dtype}, slot_mapping {list(slot_mapping.shape)} "
            f"{slot_mapping.dtype}")
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    dtypes = (BF16_DATA if qkv.dtype is _BF16 else 0) | (BF16_KV if kv_cache.dtype is _BF16 else 0)
    _check(lib.pagedserve_rotary_store_kv(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cs_stride,
        slot_mapping.data_ptr(), kv_cache.data_ptr(), num_slots, num_tokens, num_heads,
        num_kv_heads, head_dim, half, dtypes, torch.get_num_threads()))


def silu_and_mul(out: torch.Tensor, x: torch.Tensor, *, level: str | None = None) -> None:
    """x [..., 2 * I] = [gate | up] -> out [..., I] = silu(gate) * up; both float32 or both bfloat16."""
    lib = _level_library(level)
    dtype = x.dtype
    if not ((dtype is _F32 or dtype is _BF16) and _fits_data(out, dtype) and _fits_data(x, dtype)):
        _explain_data(dtype, out=out, x=x)
    shape = out.shape
    if not shape or x.shape[:-1] != shape[:-1] or x.shape[-1] != 2 * shape[-1]:
        raise ValueError(f"x {list(x.shape)} must be out {list(shape)} with a last dimension twice as long")
    inter = shape[-1]
    lib.pagedserve_silu_and_mul(out.data_ptr(), x.data_ptr(), out.numel() // inter if inter else 0,
                                inter, BF16_DATA if dtype is _BF16 else 0, torch.get_num_threads())
