"""Triton batched multi-LoRA (punica's shrink / expand) for CUDA: out[t] += (A[s, :r] . x[t]) .
Bt[s, :r], s = token_slots[t] (-1: no adapter), r = ranks[s]; kernels/reference.py's
lora_delta_reference is the spec, kernels/lora.py's apply() the caller.

Each program finds its row's adapter through token_slots, so one launch of each kernel serves a
step whatever mix of adapters it holds, with no sort and no host sync. shrink writes h [T, R] in
fp32 (one program per row, k in tiles); expand adds h . Bt[s] to out (one program per row and
BLOCK_N columns), summing in fp32 and rounding out once. Rank rows at or past ranks[s] are masked
off, never loaded, so their contents cannot reach the result. Loads of bf16 convert to fp32
before any arithmetic (the interpreter's bf16 arithmetic is wrong).

The values of token_slots and ranks are not checked here, as that would cost a sync per call: a
slot outside [0, S) is treated as -1 and a rank is clamped to [0, R], so nothing is read out of
bounds. Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagedserve.kernels.lora import check_shapes

BLOCK_K = 128
BLOCK_N = 128


@triton.jit
def _slot_rank(token_slots_ptr, ranks_ptr, row, num_slots, max_rank):
    """(slot, rank) of a row, slot -1 for one without an adapter (or a slot out of range)."""
    slot = tl.load(token_slots_ptr + row).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    rank = tl.load(ranks_ptr + tl.where(valid, slot, 0))
    rank = tl.minimum(tl.maximum(rank, 0), max_rank)
    return tl.where(valid, slot, -1), rank


@triton.jit
def shrink_kernel(h_ptr, x_ptr, token_slots_ptr, lora_a_ptr, ranks_ptr,
                  K, num_slots, max_rank, stride_x_row,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (T,): h[t, r] = A[s, r] . x[t] for r < ranks[s] (0 for the other r < R); rows without
    an adapter are left unwritten."""
    row = tl.program_id(0)
    slot, rank = _slot_rank(token_slots_ptr, ranks_ptr, row, num_slots, max_rank)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    kk = tl.arange(0, BLOCK_K)
    a_rows = lora_a_ptr + (slot * max_rank + r)[:, None] * K
    x_row = x_ptr + row.to(tl.int64) * stride_x_row
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + kk < K
        x = tl.load(x_row + k0 + kk, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + (k0 + kk)[None, :], mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], 1)
    tl.store(h_ptr + row.to(tl.int64) * max_rank + r, acc, mask=r < max_rank)


@triton.jit
def expand_kernel(out_ptr, h_ptr, token_slots_ptr, lora_b_t_ptr, ranks_ptr,
                  N, num_slots, max_rank, stride_out_row,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (T, cdiv(N, BLOCK_N)): out[t, cols] = out[t, cols] + h[t, :r] . Bt[s, :r, cols], in
    fp32, rounded once to out's dtype; rows without an adapter are left as they are."""
    row = tl.program_id(0)
    slot, rank = _slot_rank(token_slots_ptr, ranks_ptr, row, num_slots, max_rank)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    h = tl.load(h_ptr + row.to(tl.int64) * max_rank + r, mask=r_mask, other=0.0)
    bt = tl.load(lora_b_t_ptr + (slot * max_rank + r)[:, None] * N + cols[None, :],
                 mask=r_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(h[:, None] * bt, 0)
    out_ptrs = out_ptr + row.to(tl.int64) * stride_out_row + cols
    out = tl.load(out_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (out + delta).to(out_ptr.dtype.element_ty), mask=col_mask)


def _launch(kernel, grid, *args, **meta) -> None:
    """The one place the kernels start, so tests can record launches (and compile them for a GPU)."""
    kernel[grid](*args, **meta)


def _block_r(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def shrink(x: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
           ranks: torch.Tensor) -> torch.Tensor:
    """x [T, K] (unit column stride) -> h [T, R] float32: each adapted row's A[s, :r] . x[t],
    zeros for r in [ranks[s], R); rows without an adapter hold garbage (expand skips them)."""
    tokens, k = x.shape
    slots, max_rank, _ = lora_a.shape
    h = torch.empty(tokens, max_rank, dtype=torch.float32, device=x.device)
    if tokens and max_rank:
        _launch(shrink_kernel, (tokens,), h, x, token_slots, lora_a, ranks, k, slots, max_rank,
                x.stride(0), BLOCK_R=_block_r(max_rank), BLOCK_K=BLOCK_K)
    return h


def expand(h: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, lora_b_t: torch.Tensor,
           ranks: torch.Tensor) -> None:
    """In place: out [T, N] (unit column stride) += h[t, :r] . Bt[s, :r] for each adapted row."""
    tokens, n = out.shape
    slots, max_rank, _ = lora_b_t.shape
    if tokens and n and max_rank:
        _launch(expand_kernel, (tokens, triton.cdiv(n, BLOCK_N)), out, h, token_slots, lora_b_t, ranks,
                n, slots, max_rank, out.stride(0), BLOCK_R=_block_r(max_rank), BLOCK_N=BLOCK_N)


def lora_delta(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
               lora_b_t: torch.Tensor, ranks: torch.Tensor) -> None:
    """In place: out += each row's LoRA delta (shrink, then expand). Shapes and dtypes as
    kernels/lora.py checks them; x and out may have strided rows, the weights are contiguous."""
    check_shapes(x, out, token_slots, lora_a, lora_b_t, ranks)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    if out.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError("out must have unit column stride")
    lora_a, lora_b_t = lora_a.contiguous(), lora_b_t.contiguous()
    token_slots, ranks = token_slots.contiguous(), ranks.contiguous()
    expand(shrink(x, token_slots, lora_a, ranks), out, token_slots, lora_b_t, ranks)
