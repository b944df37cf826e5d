"""Batched multi-LoRA deltas: out[t] += (lora_a[s, :r] . x[t]) . lora_b_t[s, :r] for each row t
of a step, s = token_slots[t] (-1: no adapter), r = ranks[s]. One call serves a step whatever mix
of adapters its rows use, so a projection costs one call, not one per adapter.

kernels/reference.py's lora_delta_reference is the spec. apply() picks the kernel: the native one
(csrc/lora.c) on CPU, the Triton shrink / expand pair (kernels/triton_lora.py) on CUDA, else
lora_delta_torch, a batched torch formulation (one matmul pair per slot present in the step).
"""
from __future__ import annotations

import torch
from pagedserve.kernels import native
from pagedserve.kernels.native import (
    _BF16,
    _F32,
    BF16_DATA,
    BF16_WEIGHT,
    _check,
    _level_library,
)

_FLOATS = (_F32, _BF16)
_I32 = torch.int32


def usable(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
           lora_b_t: torch.Tensor, ranks: torch.Tensor) -> bool:
    """Whether the native kernel takes these operands (dtypes, device and layout; shapes are
    checked by lora_delta): CPU tensors, x and out of one dtype and lora_a and lora_b_t of one
    (each float32 or bfloat16), rows of x and out with unit column stride, contiguous weights and
    int32 slots and ranks."""
    return (x.dtype in _FLOATS and out.dtype is x.dtype and lora_a.dtype in _FLOATS
            and lora_b_t.dtype is lora_a.dtype and token_slots.dtype is _I32 and ranks.dtype is _I32
            and x.is_cpu and out.is_cpu and lora_a.is_cpu and lora_b_t.is_cpu and token_slots.is_cpu
            and ranks.is_cpu and x.dim() == 2 and out.dim() == 2
            and (x.shape[1] <= 1 or x.stride(1) == 1) and (out.shape[1] <= 1 or out.stride(1) == 1)
            and lora_a.is_contiguous() and lora_b_t.is_contiguous() and token_slots.is_contiguous()
            and ranks.is_contiguous() and native.available())


def _shapes_agree(x, out, token_slots, lora_a, lora_b_t, ranks) -> bool:
    return (x.dim() == 2 and out.dim() == 2 and token_slots.dim() == 1 and lora_a.dim() == 3
            and lora_b_t.dim() == 3 and ranks.dim() == 1 and len(token_slots) == len(x) == len(out)
            and lora_a.shape[:2] == lora_b_t.shape[:2] and lora_a.shape[2] == x.shape[1]
            and lora_b_t.shape[2] == out.shape[1] and len(ranks) == len(lora_a))


def check_shapes(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
                 lora_b_t: torch.Tensor, ranks: torch.Tensor) -> None:
    """Raises ValueError unless x [T, K], out [T, N], token_slots int32 [T], lora_a [S, R, K],
    lora_b_t [S, R, N] and ranks int32 [S] agree, x and out share a float dtype, lora_a and
    lora_b_t share one, and all are on one device."""
    if not _shapes_agree(x, out, token_slots, lora_a, lora_b_t, ranks):
        raise ValueError(f"expected x [T, K], out [T, N], token_slots [T], lora_a [S, R, K], "
                         f"lora_b_t [S, R, N] and ranks [S], got {list(x.shape)}, {list(out.shape)}, "
                         f"{list(token_slots.shape)}, {list(lora_a.shape)}, {list(lora_b_t.shape)} "
                         f"and {list(ranks.shape)}")
    if x.dtype not in _FLOATS or out.dtype != x.dtype:
        raise ValueError(f"x and out must share one dtype, float32 or bfloat16, got {x.dtype} and "
                         f"{out.dtype}")
    if lora_a.dtype not in _FLOATS or lora_b_t.dtype != lora_a.dtype:
        raise ValueError(f"lora_a and lora_b_t must share one dtype, float32 or bfloat16, got "
                         f"{lora_a.dtype} and {lora_b_t.dtype}")
    if token_slots.dtype != _I32 or ranks.dtype != _I32:
        raise ValueError(f"token_slots and ranks must be int32, got {token_slots.dtype} and {ranks.dtype}")
    devices = {t.device for t in (x, out, token_slots, lora_a, lora_b_t, ranks)}
    if len(devices) > 1:
        raise ValueError(f"expected every operand on one device, got {sorted(map(str, devices))}")


def check_values(token_slots: torch.Tensor, ranks: torch.Tensor, max_rank: int) -> None:
    """Raises ValueError (the native kernel's message) for a slot that is neither -1 nor below
    len(ranks), or a rank outside [0, max_rank]. Reads the values: on a GPU, a sync."""
    slots = len(ranks)
    if (bool(((token_slots < -1) | (token_slots >= slots)).any())
            or bool(((ranks < 0) | (ranks > max_rank)).any())):
        raise ValueError(native._STATUS[9][1])


def lora_delta(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
               lora_b_t: torch.Tensor, ranks: torch.Tensor, level: str | None = None) -> None:
    """In place, by the native kernel (csrc/lora.c): out [T, N] += each row's LoRA delta (see the
    module docstring). x and out may have strided rows (out a column slice of a wider tensor);
    level picks another CPU level's library (tests, benchmarks)."""
    lib = _level_library(level)
    # One expression on the fast path (this runs per projection per step); explained if it fails.
    if not (usable(x, out, token_slots, lora_a, lora_b_t, ranks)
            and _shapes_agree(x, out, token_slots, lora_a, lora_b_t, ranks)
            and (len(out) <= 1 or out.stride(0) >= out.shape[1])):
        check_shapes(x, out, token_slots, lora_a, lora_b_t, ranks)
        if not usable(x, out, token_slots, lora_a, lora_b_t, ranks):
            raise ValueError("the native LoRA kernel needs CPU tensors, x and out with unit column "
                             "stride, contiguous lora_a, lora_b_t, token_slots and ranks")
        raise ValueError(f"out's rows overlap: row stride {out.stride(0)} below its "
                         f"{out.shape[1]} columns")
    tokens, n = out.shape
    slots, max_rank, k = lora_a.shape
    dtypes = (BF16_DATA if x.dtype is _BF16 else 0) | (BF16_WEIGHT if lora_a.dtype is _BF16 else 0)
    _check(lib.pagedserve_lora_delta(
        out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), token_slots.data_ptr(),
        lora_a.data_ptr(), lora_b_t.data_ptr(), ranks.data_ptr(), tokens, k, n, slots, max_rank,
        dtypes, torch.get_num_threads()))


def lora_delta_torch(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
                     lora_a: torch.Tensor, lora_b_t: torch.Tensor, ranks: torch.Tensor) -> None:
    """lora_delta in torch ops, on any device: per slot present in the step (at most S), its rows
    gathered, one shrink and one expand matmul in float32, the sums added to out in fp32 and
    rounded once, as the reference."""
    check_shapes(x, out, token_slots, lora_a, lora_b_t, ranks)
    check_values(token_slots, ranks, lora_a.shape[1])
    slots = token_slots.long()
    ranks_cpu = ranks.tolist()
    for s in torch.unique(slots[slots >= 0]).tolist():
        r = ranks_cpu[s]
        if r == 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        h = x.index_select(0, rows).float() @ lora_a[s, :r].float().T
        updated = out.index_select(0, rows).float() + h @ lora_b_t[s, :r].float()
        out.index_copy_(0, rows, updated.to(out.dtype))


def apply(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
          lora_b_t: torch.Tensor, ranks: torch.Tensor) -> None:
    """out += each row's LoRA delta, by the best kernel for the operands: Triton on CUDA, the
    native kernel on CPU where it takes them, else lora_delta_torch."""
    if x.is_cuda:
        # Imported here: Triton is only needed (and only installed) where there is a GPU.
        from pagedserve.kernels import triton_lora
        triton_lora.lora_delta(x, out, token_slots, lora_a, lora_b_t, ranks)
    elif usable(x, out, token_slots, lora_a, lora_b_t, ranks):
        lora_delta(x, out, token_slots, lora_a, lora_b_t, ranks)
    else:
        lora_delta_torch(x, out, token_slots, lora_a, lora_b_t, ranks)
