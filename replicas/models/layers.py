"""The building blocks every model file shares: projections on packed CPU weights, embeddings,
norms and activations. Parameters are allocated empty; load_weights fills each of them.

A quantized checkpoint's projections and embeddings arrive as pagedserve.kernels.quantized.QuantWeight
parts instead of dense tensors. So that they never cost the dense bytes, a model built under
`deferred_weights()` gives every projection and embedding a weight on the meta device (a shape,
no storage), materialised only if the checkpoint holds that weight dense after all.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_linear, norm_act, quant_linear
from pagedserve.kernels.quantized import QuantWeight, cat_rows, share_input_order
from pagedserve.kernels.reference import dequantize_weight

_deferred = contextvars.ContextVar("deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights():
    """Build a model whose projection and embedding weights may come quantized."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def empty_parameter(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _weight(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return empty_parameter(*shape, dtype=dtype, device="meta" if _deferred.get() else device)


def materialize(module: nn.Module, attribute: str, device) -> nn.Parameter:
    """module.attribute, given storage if it was deferred (meta) and the checkpoint holds it dense."""
    param = getattr(module, attribute)
    if param.is_meta:
        param = empty_parameter(*param.shape, dtype=param.dtype, device=device)
        setattr(module, attribute, param)
    return param


class QuantParts:
    """The QuantWeight parts of one weight, by first row (q|k|v or gate|up arrive separately)."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.parts: dict[int, QuantWeight] = {}

    def add(self, first_row: int, weight: QuantWeight) -> None:
        self.parts[first_row] = weight

    def joined(self, name: str) -> list[QuantWeight]:
        """The parts as one weight or, where their input-channel orders differ (GPTQ act-order
        quantized each separately), as they are, each its own GEMM."""
        starts = sorted(self.parts)
        row = 0
        for start in starts:
            if start != row:
                break
            row += self.parts[start].shape[0]
        if row != self.num_rows:
            raise ValueError(f"{name}: quantized parts cover rows 0..{row} of {self.num_rows} "
                             "(a fused projection must be quantized in all of its parts)")
        parts = [self.parts[s] for s in starts]
        return [cat_rows(parts)] if share_input_order(parts) else parts


def pack_quantized(weight: QuantWeight, device: torch.device):
    """A QuantWeight packed for the kernel of its device: csrc/gemm_q.c on CPU, Triton on CUDA."""
    if device.type == "cuda":
        from pagedserve.kernels import triton_quant
        return triton_quant.pack(weight, device)
    return quant_linear.pack(weight)


def quantized_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(packed, quant_linear.PackedQuant):
        return quant_linear.linear(x, packed, bias)
    from pagedserve.kernels import triton_quant
    return triton_quant.linear(x, packed, bias)


class Linear(nn.Module):
    """y = x W^T + b on a weight packed once after loading: dense (kernels/cpu_linear.py) or
    quantized (pack_quantized)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _weight(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.packed: cpu_linear.PackedWeight | None = None  # set by pack(), after loading
        self.quant: QuantParts | None = None  # the weight's parts, if it came quantized
        self.packed_quant: list | None = None  # pack_quantized's results, if it came quantized
        self.lora = None  # its LoRA slots (replicas/lora/slots.py) when adapters are enabled
        self.device = torch.device(device)

    def load_quantized(self, first_row: int, weight: QuantWeight) -> None:
        if weight.shape[1] != self.weight.shape[1]:
            raise ValueError(f"quantized weight of shape {list(weight.shape)} does not fit a "
                             f"projection of {list(self.weight.shape)}")
        self.quant = self.quant or QuantParts(self.weight.shape[0])
        self.quant.add(first_row, weight)

    def pack(self, name: str = "") -> None:
        if self.quant is not None:
            self.packed_quant = [pack_quantized(part, self.device) for part in self.quant.joined(name)]
            self.quant = None
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
            return
        if self.weight.is_meta:
            raise ValueError(f"{name}: no weight was loaded")
        self.packed = cpu_linear.pack(self.weight)
        if self.packed is not None and self.packed.replaces_weight:  # keep one copy in memory
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_quant is not None:
            if len(self.packed_quant) == 1:
                out = quantized_linear(x, self.packed_quant[0], self.bias)
            else:
                out = torch.cat([quantized_linear(x, part) for part in self.packed_quant], dim=-1)
                out = out if self.bias is None else out + self.bias
        else:
            out = cpu_linear.linear(x, self.weight, self.packed, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, out)
        return out


class Embedding(nn.Module):
    """Token embeddings; quantized ones are looked up by dequantizing the step's rows (a few
    KiB a step), so the table keeps its quantized size, and a tied lm_head multiplies by it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = _weight(num_embeddings, embedding_dim, dtype=dtype, device=device)
        self.quantized: QuantWeight | None = None
        self.device = torch.device(device)

    def load_quantized(self, first_row: int, weight: QuantWeight) -> None:
        if first_row != 0 or weight.shape != tuple(self.weight.shape):
            raise ValueError(f"quantized embedding of shape {list(weight.shape)} does not fit "
                             f"{list(self.weight.shape)}")
        self.quantized = QuantWeight(weight.bits, weight.group_size, *(
            t.to(self.device) for t in (weight.q, weight.scales, weight.offsets)),
            None if weight.perm is None else weight.perm.to(self.device))
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return dequantize_weight(self.quantized.rows(input_ids)).to(self.weight.dtype)
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
