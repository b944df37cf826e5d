"""Paged attention in the native library, through the library kernels/native.py loads: decode
(csrc/paged_attention.c) and prefill (csrc/prefill_attention.c), fp32 or bf16 queries over an
fp32 or bf16 KV cache, fp32 inside."""
from __future__ import annotations

import torch

from pagedserve.kernels.native import (
    _BF16, _F32, BF16_DATA, BF16_KV, _check, _explain_data, _fits_data, _level_library,
)


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype is not torch.int32 or not t.is_cpu or not t.is_contiguous() or t.shape != shape:
        raise ValueError(f"{name} must be a contiguous int32 CPU tensor of shape {list(shape)}, "
                         f"got {t.dtype} {list(t.shape)} on {t.device}")


def rows_contiguous(query: torch.Tensor) -> bool:
    """Whether each row [num_heads, head_dim] of a 3-D query is contiguous (rows may be strided):
    query[0].is_contiguous() without making the view, which costs more than these stride reads."""
    _, num_heads, head_dim = query.shape
    return (head_dim == 1 or query.stride(2) == 1) and (num_heads == 1 or query.stride(1) == head_dim)


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None,
                           logits_soft_cap: float | None = None, level: str | None = None) -> None:
    """Decode attention into out, reading K/V in place through the block tables.

    query, out [num_tokens, num_heads, head_dim], both float32 or both bfloat16 (query's rows may
    be strided, as a view of a fused QKV projection); kv_cache [2, num_blocks, block_size,
    num_kv_heads, head_dim], float32 or bfloat16 (half the bytes read; each row widened once);
    block_tables int32 [batch, width]; seq_lens int32 [batch]; query_start_loc int32 [batch + 1].
    Scores, softmax and sums are fp32; a bf16 out is rounded once. Only the rows of sequences
    with query_len 1 are written: the others (prefills) are left as they are.
    sliding_window and logits_soft_cap as in kernels/reference.py; block table entries wholly
    outside the window are never read (nor checked). level: another CPU level's kernel.
    """
    _attention("pagedserve_paged_decode_attention", out, query, kv_cache, block_tables, seq_lens,
               query_start_loc, scale, sliding_window, logits_soft_cap, level)


def paged_prefill_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, *,
                            level: str | None = None) -> None:
    """Prefill attention into out, causal (query i of a sequence at position seq_len - query_len
    + i), reading K/V in place through the block tables; the arguments as paged_decode_attention's.
    Only the rows of sequences with query_len > 1 are written. No sliding window or soft cap, and
    head_dim a multiple of 16 (see supports_prefill): the torch path takes the rest."""
    if query.dim() == 3 and not supports_prefill(query.shape[2]):
        raise ValueError(f"prefill attention needs a head_dim that is a multiple of 16, "
                         f"got {query.shape[2]}")
    _attention("pagedserve_paged_prefill_attention", out, query, kv_cache, block_tables, seq_lens,
               query_start_loc, scale, None, None, level)


def supports_prefill(head_dim: int) -> bool:
    return head_dim % 16 == 0


def _attention(kernel: str, out, query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
               sliding_window, logits_soft_cap, level) -> None:
    lib = _level_library(level)
    dtype, kv_dtype = out.dtype, kv_cache.dtype
    if not (_fits_data(out, dtype) and (dtype is _F32 or dtype is _BF16) and query.dtype is dtype
            and query.is_cpu and (kv_dtype is _F32 or kv_dtype is _BF16) and _fits_data(kv_cache, kv_dtype)):
        _explain_data(dtype, out=out, query=query.contiguous())
        _explain_data(kv_dtype, kv_cache=kv_cache)
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("expected query [num_tokens, num_heads, head_dim] and kv_cache "
                         "[2, num_blocks, block_size, num_kv_heads, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} x {head_dim} do not fit KV heads "
                         f"{num_kv_heads} x {cache_head_dim}")
    if out.shape != query.shape:
        raise ValueError(f"out {list(out.shape)} must have query's shape {list(query.shape)}")
    if num_tokens and not rows_contiguous(query):
        raise ValueError("each query row [num_heads, head_dim] must be contiguous")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    width = block_tables.shape[-1] if block_tables.dim() else -1
    _check_index("seq_lens", seq_lens, (batch,))
    _check_index("query_start_loc", query_start_loc, (batch + 1,))
    _check_index("block_tables", block_tables, (batch, width))
    dtypes = (BF16_DATA if dtype is _BF16 else 0) | (BF16_KV if kv_dtype is _BF16 else 0)
    _check(getattr(lib, kernel)(
        out.data_ptr(), query.data_ptr(), query.stride(0), kv_cache.data_ptr(), num_blocks, block_size,
        block_tables.data_ptr(), width, seq_lens.data_ptr(), query_start_loc.data_ptr(),
        batch, num_tokens, num_heads, num_kv_heads, head_dim, scale, sliding_window or 0,
        logits_soft_cap or 0.0, dtypes, torch.get_num_threads()))
