"""Feed-forward blocks: the gated MLP of Llama-style models (gate and up fused into one matmul)
and the plain two-matmul MLP of GPT-2, GPT-NeoX and OPT.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.replicas.models.layers import Linear, act_and_mul, activation
from pagedserve.replicas.parallel import state as parallel_state


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate_up_proj's rows are [gate | up]. Under tensor parallelism
    both halves are this rank's share of the intermediate rows, and down's sums are all-reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dtype: torch.dtype, device,
                 bias: bool = False):
        super().__init__()
        self.tp = parallel_state.current()
        intermediate_size //= self.tp.world_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)
        self.act_and_mul = act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return out if self.tp.world_size == 1 else self.tp.all_reduce(out)


class MLP(nn.Module):
    """down(act(up(x))). Under tensor parallelism up holds this rank's share of the intermediate
    rows, and down's sums are all-reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dtype: torch.dtype, device,
                 bias: bool = True):
        super().__init__()
        self.tp = parallel_state.current()
        intermediate_size //= self.tp.world_size
        self.up_proj = Linear(hidden_size, intermediate_size, bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.up_proj(x)))
        return out if self.tp.world_size == 1 else self.tp.all_reduce(out)
