"""Which attention implementation the engine runs: a setting with an automatic default."""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch

from pagedserve.kernels import reference, rotary


class AttentionBackend(NamedTuple):
    name: str
    store_kv: Callable
    paged_attention: Callable
    rotary_store_kv: Callable  # pagedserve.kernels.rotary.rotary_store_kv's signature, over this store_kv


def _backend(name: str, store_kv: Callable, paged_attention: Callable,
             rotary_store_kv: Callable = rotary.rotary_store_kv) -> AttentionBackend:
    return AttentionBackend(name, store_kv, paged_attention,
                            partial(rotary_store_kv, store_kv=store_kv))


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "reference":
        return _backend("reference", reference.store_kv, reference.paged_attention,
                        rotary.rotary_store_kv_reference)
    if name == "torch":
        from pagedserve.kernels import torch_attention
        return _backend("torch", torch_attention.store_kv, torch_attention.paged_attention)
    if name == "triton":
        from pagedserve.kernels import triton_attention
        return _backend("triton", triton_attention.store_kv, triton_attention.paged_attention)
    raise ValueError(f"unknown attention backend {name!r}: use auto, torch, triton or reference")
