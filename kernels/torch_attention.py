"""Fast CPU paged attention: the reference's semantics, batched and without host syncs.

float32 decodes run in the native C kernel (kernels/native.py) when it is available: it reads K/V
in place through the block tables, where the torch path below copies them out first. Otherwise,
decode sequences (query_len 1) run in groups whose gathered K/V stay cache-sized (a batch too big
for one group is sorted by context length first, so groups pad little); each group is one block
gather plus one scaled_dot_product_attention call
with the query heads of a KV head laid out as that head's "query positions" (GQA without copying
K/V per query head). Prefill chunks go one sequence at a time through SDPA with enable_gqa, causal
with the offset seq_len - query_len.

Dtypes, as measured: decode is memory-bound, so bf16 decodes run in bf16 (half the bytes gathered;
SDPA accumulates in fp32); prefill is compute-bound and bf16 SDPA is no faster than fp32 on this
CPU, so prefill runs in fp32 (more accurate for free). fp16 always runs in fp32: torch's CPU fp16
kernels are several times slower.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native
from kernels.metadata import AttentionMetadata

# Bytes of gathered K+V per decode group. Measured on a 2-core Zen 4: one big batched gather spills
# to DRAM and page-faults (2-3x slower at 64 x 1024 tokens), per-sequence calls pay Python overhead
# on short contexts; 1-4 MB groups were equally good, 8 MB and up slower.
DECODE_GROUP_BYTES = 2 << 20


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> their slots in kv_cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def decode_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float16 else dtype


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, *, use_native: bool = True) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape and dtype.

    use_native=False keeps float32 decodes on the torch path (tests and benchmarks compare them).
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous, whatever query is
    starts = metadata.query_start_loc_cpu
    decodes = [b for b, q_len in enumerate(metadata.query_lens_cpu) if q_len == 1]
    if decodes and use_native and _native_decode(query, kv_cache):
        if not query[0].is_contiguous():  # strided rows are fine, strided heads are not
            query = query.contiguous()
        # One call for the whole batch: the kernel skips the prefills, written below.
        native.paged_decode_attention(out, query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                      metadata.query_start_loc, scale)
    elif decodes:
        _decode(query, kv_cache, metadata, scale, out, starts, decodes)
    for b, q_len in enumerate(metadata.query_lens_cpu):
        if q_len > 1:
            _prefill(query, kv_cache, metadata, scale, out, starts[b], q_len, b)
    return out


def _native_decode(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (query.dtype == torch.float32 and kv_cache.dtype == torch.float32 and query.is_cpu
            and kv_cache.is_contiguous() and native.available())


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """cache [num_blocks, block_size, h, d], block_ids [num_seqs * n] -> [num_seqs, h, n * block_size, d]."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_ids)
    return blocks.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)


def _decode_groups(decodes: list[int], seq_lens: list[int], token_bytes: int) -> list[list[int]]:
    """Decode sequences in groups whose K/V, padded to the group's longest, fit DECODE_GROUP_BYTES.

    A batch that fits whole stays one group in batch order; otherwise sequences are sorted by
    length first, so each group pads little.
    """
    if len(decodes) * max(seq_lens[b] for b in decodes) * token_bytes <= DECODE_GROUP_BYTES:
        return [decodes]
    order = sorted(decodes, key=lambda b: seq_lens[b])
    groups, first = [], 0
    while first < len(order):
        last = first + 1
        while (last < len(order)
               and (last - first + 1) * seq_lens[order[last]] * token_bytes <= DECODE_GROUP_BYTES):
            last += 1
        groups.append(order[first:last])
        first = last
    return groups


def _decode(query, kv_cache, metadata, scale, out, starts, decodes) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    dtype = decode_dtype(kv_cache.dtype)
    device = query.device
    seq_lens = metadata.seq_lens_cpu
    token_bytes = 2 * num_kv_heads * head_dim * kv_cache.element_size()
    for members in _decode_groups(decodes, seq_lens, token_bytes):
        count = len(members)
        lens = [seq_lens[b] for b in members]
        max_len = max(lens)
        num_blocks = (max_len + block_size - 1) // block_size
        if count == metadata.num_seqs:  # the whole batch, all decodes, in order: no index tensors
            rows = None
            tables = metadata.block_tables[:, :num_blocks]
            q = query
        else:
            rows = torch.tensor([starts[b] for b in members], device=device)
            tables = metadata.block_tables.index_select(0, torch.tensor(members, device=device))[:, :num_blocks]
            q = query.index_select(0, rows)
        block_ids = tables.flatten().long()
        k = _gather(kv_cache[0], block_ids, count).to(dtype)
        v = _gather(kv_cache[1], block_ids, count).to(dtype)
        # [count, num_kv_heads, group, head_dim]: a KV head's query heads act as its query positions.
        q = q.to(dtype).reshape(count, num_kv_heads, group, head_dim)
        mask = None
        if min(lens) != max_len:  # ragged: mask each sequence's padding
            positions = torch.arange(num_blocks * block_size, device=device)
            padding = positions[None, :] >= torch.tensor(lens, device=device)[:, None]
            mask = torch.zeros(count, 1, 1, positions.numel(), dtype=dtype, device=device)
            mask.masked_fill_(padding[:, None, None, :], float("-inf"))
        elif num_blocks * block_size != max_len:  # equal lengths: trim the last block's tail
            k, v = k[:, :, :max_len], v[:, :, :max_len]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.reshape(count, num_heads, head_dim).to(out.dtype)
        if rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, rows, o)


def _prefill(query, kv_cache, metadata, scale, out, start, q_len, b) -> None:
    block_size = kv_cache.shape[2]
    dtype = torch.float32
    s_len = metadata.seq_lens_cpu[b]
    num_blocks = (s_len + block_size - 1) // block_size
    block_ids = metadata.block_tables[b, :num_blocks].long()
    k = _gather(kv_cache[0], block_ids, 1)[:, :, :s_len].to(dtype)
    v = _gather(kv_cache[1], block_ids, 1)[:, :, :s_len].to(dtype)
    q = query[start:start + q_len].to(dtype).transpose(0, 1)[None]  # [1, num_heads, q_len, d]
    if q_len == s_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at position s_len - q_len + i (is_causal would align it to position i).
        q_pos = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        mask = torch.arange(s_len, device=query.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start:start + q_len] = o[0].transpose(0, 1).to(out.dtype)
