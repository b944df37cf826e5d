"""Which attention implementation the engine runs: a setting with an automatic default."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from kernels import reference


class AttentionBackend(NamedTuple):
    name: str
    store_kv: Callable
    paged_attention: Callable


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "reference":
        return AttentionBackend("reference", reference.store_kv, reference.paged_attention)
    if name == "torch":
        try:
            from kernels import torch_attention
        except ImportError:  # the fast CPU path is optional until it lands
            return AttentionBackend("reference", reference.store_kv, reference.paged_attention)
        return AttentionBackend("torch", torch_attention.store_kv, torch_attention.paged_attention)
    if name == "triton":
        from kernels import triton_attention
        return AttentionBackend("triton", triton_attention.store_kv, triton_attention.paged_attention)
    raise ValueError(f"unknown attention backend {name!r}: use auto, torch, triton or reference")
