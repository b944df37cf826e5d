"""Triton paged attention: the backend's store_kv and paged_attention, launching triton_kernels.

One batch may mix decodes and prefill chunks. Both kernels see the whole batch and each skips the
other's sequences on the device (query_start_loc tells them apart), so no per-kind index tensors
are built and nothing waits on the device; the host only decides which kernels to launch, from
metadata.query_lens_cpu.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels import triton_kernels
from pagedserve.kernels.metadata import AttentionMetadata

# Context positions per K/V tile, per kernel. 16 is tl.dot's smallest tile; larger tiles mean fewer
# loop trips (and far fewer interpreter steps). Prefill tiles trade registers for reuse.
DECODE_TILE_N = 64
PREFILL_BLOCK_M = 64
PREFILL_TILE_N = 64
# Split-K: below this many (sequence, KV head) programs the GPU has idle SMs, and a long context
# is cut into splits of at least MIN_SPLIT_TOKENS positions.
MIN_SPLIT_TOKENS = 512
MAX_SPLITS = 32

_COMPUTE_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _launch(kernel, grid, *args, **meta) -> None:
    """The one place kernels start, so tests can record launches (and compile them for a GPU)."""
    kernel[grid](*args, **meta)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_dtype(query: torch.Tensor, kv_cache: torch.Tensor):
    """(tl.dot input dtype, input precision): fp32 whenever either side is fp32 or interpreted."""
    if _interpreting() or query.dtype == torch.float32 or kv_cache.dtype == torch.float32:
        return tl.float32, "ieee"
    return _COMPUTE_DTYPES[kv_cache.dtype], "ieee"  # precision only matters for fp32 inputs


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must be contiguous along head_dim")
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Kernels index [tokens, heads] by strides but need unit stride along head_dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> their slots in kv_cache."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _rows(key), _rows(value)
    _launch(triton_kernels.store_kv_kernel, (num_tokens,),
            key, value, kv_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *_cache_strides(kv_cache), num_kv_heads, head_dim,
            BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number keeps the heuristic testable
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(metadata: AttentionMetadata, kv_cache: torch.Tensor, num_heads: int,
                      sliding_window: int | None = None) -> int:
    """Split-K factor for the decodes of this batch: 1 unless programs would leave SMs idle."""
    decode_lens = [min(s, sliding_window or s)
                   for q, s in zip(metadata.query_lens_cpu, metadata.seq_lens_cpu) if q == 1]
    if not decode_lens:
        return 1
    programs = len(decode_lens) * kv_cache.shape[3]
    num_sms = _num_sms(kv_cache.device)
    if programs >= num_sms:
        return 1
    # About two waves of programs, each split still MIN_SPLIT_TOKENS positions or more.
    by_length = max(decode_lens) // MIN_SPLIT_TOKENS
    return max(1, min(triton.cdiv(2 * num_sms, programs), by_length, MAX_SPLITS))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape and dtype.

    sliding_window and logits_soft_cap as in kernels/reference.py. num_splits forces the decode
    split-K factor (1: no split); None lets choose_num_splits decide.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    query = _rows(query)
    group = num_heads // num_kv_heads
    compute_dtype, precision = _dot_dtype(query, kv_cache)
    common = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
              *_cache_strides(kv_cache), metadata.block_tables.stride(0))
    options = (sliding_window or 0, (logits_soft_cap or 0.0) * triton_kernels.LOG2E)
    meta = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_D=_block_d(head_dim),
                COMPUTE_DTYPE=compute_dtype, PRECISION=precision,
                HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=logits_soft_cap is not None)
    num_seqs = metadata.num_seqs
    qk_scale = scale * triton_kernels.LOG2E

    if 1 in metadata.query_lens_cpu:
        splits = num_splits or choose_num_splits(metadata, kv_cache, num_heads, sliding_window)
        if splits > 1:
            partial_out = torch.empty(num_seqs, num_heads, splits, meta["BLOCK_D"],
                                      dtype=torch.float32, device=query.device)
            partial_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
        else:
            partial_out = partial_lse = out  # unused
        _launch(triton_kernels.decode_kernel, (num_seqs, num_kv_heads, splits),
                out, partial_out, partial_lse, query, kv_cache, metadata.block_tables,
                metadata.seq_lens, metadata.query_start_loc, qk_scale, *common, num_heads, *options,
                BLOCK_G=max(16, triton.next_power_of_2(group)), TILE_N=DECODE_TILE_N,
                NUM_SPLITS=splits, num_warps=4, **meta)
        if splits > 1:
            _launch(triton_kernels.reduce_splits_kernel, (num_seqs, num_heads),
                    out, partial_out, partial_lse, metadata.query_start_loc,
                    out.stride(0), out.stride(1), num_heads,
                    HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], NUM_SPLITS=splits,
                    BLOCK_S=triton.next_power_of_2(splits), num_warps=1)

    if metadata.max_query_len > 1:
        grid = (num_seqs, triton.cdiv(metadata.max_query_len, PREFILL_BLOCK_M), num_heads)
        _launch(triton_kernels.prefill_kernel, grid,
                out, query, kv_cache, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, qk_scale, *common, *options,
                BLOCK_M=PREFILL_BLOCK_M, TILE_N=PREFILL_TILE_N, num_warps=4, **meta)
    return out
