"""Rotary embedding of q and k and the KV-cache store, as one step of an attention layer.

`apply_rotary` is the rotation (the half-split form HF's Llama, NeoX and their kin use), and
`rotary_store_kv` the layer's whole step: q and k of a fused QKV projection rotated, k and v
stored in their cache slots. On CPU the native kernel (csrc/rotary_kv.c) does that in one pass,
in place; elsewhere, or for operands it does not take, the reference below runs (it is the spec).
"""
from __future__ import annotations

import torch

from pagedserve.kernels import native_norm_act, reference


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] -> rotated copy; dims past 2 * cos.shape[-1] pass through."""
    half = cos.shape[-1]
    if 2 * half != x.shape[-1]:
        rotated = apply_rotary(x[..., :2 * half], cos, sin)
        return torch.cat((rotated, x[..., 2 * half:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] -> views q, k, v [T, heads, D]."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1)
    num_tokens = qkv.shape[0]
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def rotary_store_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                              num_kv_heads: int, head_dim: int, store_kv=reference.store_kv
                              ) -> torch.Tensor:
    """The spec: rotated q [T, num_heads, head_dim]; rotated k and v stored at slot_mapping."""
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    store_kv(k, v, kv_cache, slot_mapping)
    return q


def rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, store_kv=reference.store_kv) -> torch.Tensor:
    """rotary_store_kv_reference's result; natively (q rotated inside qkv, which it then views)
    where the kernel takes the operands, else through the reference with this `store_kv`."""
    if native_norm_act.takes_rotary_store_kv(qkv, cos, sin, kv_cache, slot_mapping):
        native_norm_act.rotary_store_kv(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads,
                                        head_dim)
        return qkv[:, :num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
    return rotary_store_kv_reference(qkv, cos, sin, kv_cache, slot_mapping, num_heads,
                                     num_kv_heads, head_dim, store_kv)
