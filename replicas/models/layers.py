"""The building blocks every model file shares: projections on packed CPU weights, embeddings,
norms and activations. Parameters are allocated empty; load_weights fills each of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear, norm_act


def empty_parameter(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b on a weight packed once after loading (kernels/cpu_linear.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.packed: cpu_linear.PackedWeight | None = None  # set by pack(), after loading

    def pack(self) -> None:
        self.packed = cpu_linear.pack(self.weight)
        if self.packed is not None and self.packed.replaces_weight:  # keep one copy in memory
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.packed, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = empty_parameter(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the model dtype, like the HF Llama reference.

    norm(x) -> y; norm(x, residual) -> (norm(x + residual), x + residual), fused on CPU.
    Gemma's (1 + w) variant is the same norm with 1 added to w when it is loaded.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.weight = empty_parameter(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return norm_act.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """torch's LayerNorm on loaded parameters; affine=False (OPT's option) has none."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device, *, affine: bool = True,
                 bias: bool = True):
        super().__init__()
        self.size, self.eps = size, eps
        self.weight = empty_parameter(size, dtype=dtype, device=device) if affine else None
        self.bias = empty_parameter(size, dtype=dtype, device=device) if affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.size,), self.weight, self.bias, self.eps)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's formula, written out as transformers' NewGELUActivation does (not bit-equal to
    # F.gelu(approximate="tanh")).
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


# transformers' ACT2FN names -> the function (only those the supported families use)
ACTIVATIONS = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_new": _gelu_new, "gelu_pytorch_tanh": _gelu_tanh,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}: supported are {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def act_and_mul(name: str):
    """[..., 2 * I] = [gate | up] -> act(gate) * up; silu takes the fused native kernel."""
    if name in ("silu", "swish"):
        return norm_act.silu_and_mul
    act = activation(name)

    def fn(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up
    return fn
