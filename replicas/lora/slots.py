"""The slot pool: max_loras adapters at once, each in a slot of every projection it may change.

Each target projection holds, per part (q, k and v of a fused qkv_proj are three parts), A
[max_loras, max_lora_rank, in] and B transposed [max_loras, max_lora_rank, rows] with the LoRA
scaling folded in, and each slot's rank (0 where its adapter leaves that part alone). A step's
rows name their slot in one int32 tensor, shared by every projection (`LoRAStep`); the kernel
(kernels/lora.py) adds the delta of every row's adapter in one call per part, whatever the mix.
"""
from __future__ import annotations

import torch

from pagedserve.kernels import lora as lora_kernels


class LoRAStep:
    """What every projection reads in a step: each row's slot (-1: the base model), or None
    when no row of the step runs an adapter."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None


class LoRASlots:
    """One projection's slots (see the module doc)."""

    def __init__(self, step: LoRAStep, parts: list[tuple[int, int]], in_features: int,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.step = step
        self.parts = parts
        self.lora_a = [torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device)
                       for _ in parts]
        self.lora_b_t = [torch.zeros(max_loras, max_rank, stop - start, dtype=dtype, device=device)
                         for start, stop in parts]
        self.ranks = [torch.zeros(max_loras, dtype=torch.int32, device=device) for _ in parts]

    def set(self, slot: int, part: int, a: torch.Tensor, b_t: torch.Tensor) -> None:
        """Slot `slot` of part `part` becomes a [r, in] with b_t [r, rows]."""
        rank = a.shape[0]
        self.lora_a[part][slot, :rank].copy_(a)
        self.lora_b_t[part][slot, :rank].copy_(b_t)
        self.ranks[part][slot] = rank

    def clear(self, slot: int) -> None:
        for ranks in self.ranks:
            ranks[slot] = 0

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        token_slots = self.step.token_slots
        if token_slots is None:
            return
        for (start, stop), a, b_t, ranks in zip(self.parts, self.lora_a, self.lora_b_t, self.ranks):
            lora_kernels.apply(x, out[:, start:stop], token_slots, a, b_t, ranks)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.lora_a, *self.lora_b_t))
