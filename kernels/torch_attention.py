"""Fast CPU paged attention: the reference's semantics, batched and without host syncs.

float32 and bfloat16 decodes and prefills (either over a float32 or a bfloat16 KV cache) run in
the native C kernels (kernels/native_attention.py) when they are available, on every CPU level:
they read K/V in place through the block tables, where the torch path below copies them out first.
Prefills with a sliding window, a soft cap or a head_dim that is not a multiple of 16 keep the
torch path, as does everything when use_native=False. There, decode sequences (query_len 1) run
in groups whose gathered K/V stay cache-sized (a batch too big for one group is sorted by context
length first, so groups pad little); each group is one block gather plus one
scaled_dot_product_attention call with the query heads of a KV head laid out as that head's "query
positions" (GQA without copying K/V per query head). Prefill chunks go one sequence at a time
through SDPA with enable_gqa, causal with the offset seq_len - query_len.

Dtypes on the torch path: decode is memory-bound, so bf16 decodes run in bf16 (half the bytes
gathered; SDPA accumulates in fp32); prefill is compute-bound and bf16 SDPA on CPU is no faster
than fp32, so prefill runs in fp32 (more accurate for free). fp16 always runs in fp32:
torch's CPU fp16 kernels are several times slower.

A sliding window gathers only the blocks some query's window reaches (a long prefill runs in query
tiles, each gathering its own span), so dropped blocks are never read and the cost follows the
window, not the context. A logits soft cap needs the scores themselves, so those calls compute
softmax(cap * tanh(q k^T * scale / cap)) v explicitly instead of calling SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import native, native_attention
from pagedserve.kernels.metadata import AttentionMetadata

# Bytes of gathered K+V per decode group: one big batched gather spills to DRAM and page-faults,
# per-sequence calls pay Python overhead on short contexts; a group that stays cache-sized avoids
# both (bench/kernels.py --cpu times the torch path).
DECODE_GROUP_BYTES = 2 << 20
# Queries per call of a windowed or soft-capped prefill: a tile reads only the keys its window
# reaches, and a soft cap's explicit scores stay [heads, tile, tile + window] floats.
PREFILL_QUERY_TILE = 512


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
                    scale: float, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, use_native: bool = True) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape and dtype.

    sliding_window and logits_soft_cap as in kernels/reference.py. use_native=False keeps
    decodes and prefills on the torch path (tests and benchmarks compare them).
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous, whatever query is
    starts = metadata.query_start_loc_cpu
    query_lens = metadata.query_lens_cpu
    decodes = [b for b, q_len in enumerate(query_lens) if q_len == 1]
    native = use_native and _native(query, kv_cache)
    if native and not native_attention.rows_contiguous(query):  # strided rows are fine, not heads
        query = query.contiguous()
    if decodes and native:
        # One call for the whole batch: the kernel skips the prefills, written below.
        native_attention.paged_decode_attention(
            out, query, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    elif decodes and sliding_window is None and logits_soft_cap is None:
        _decode(query, kv_cache, metadata, scale, out, starts, decodes)
    elif decodes:
        _decode_windowed(query, kv_cache, metadata, scale, out, starts, decodes, sliding_window,
                         logits_soft_cap)
    if len(decodes) == len(query_lens):
        return out
    if (native and sliding_window is None and logits_soft_cap is None
            and native_attention.supports_prefill(query.shape[2])):
        # One call for every prefill: it skips the decodes, written above.
        native_attention.paged_prefill_attention(
            out, query, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            scale)
        return out
    for b, q_len in enumerate(query_lens):
        if q_len <= 1:
            continue
        if sliding_window is None and logits_soft_cap is None:
            _prefill(query, kv_cache, metadata, scale, out, starts[b], q_len, b)
        else:
            _prefill_windowed(query, kv_cache, metadata, scale, out, starts[b], q_len, b,
                              sliding_window, logits_soft_cap)
    return out


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (query.dtype in _NATIVE_DTYPES and kv_cache.dtype in _NATIVE_DTYPES and query.is_cpu
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


def _attend(q, k, v, mask, scale, logits_soft_cap):
    """softmax(q k^T * scale [soft-capped], masked) v, with GQA: q [n, kv_heads, m, d] against
    k, v [n, kv_heads, s, d]; mask (True = attend) broadcasts against [n, kv_heads, m, s]."""
    if logits_soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _decode_windowed(query, kv_cache, metadata, scale, out, starts, decodes, sliding_window,
                     logits_soft_cap) -> None:
    """Decodes with a window and/or soft cap: each sequence gathers only the blocks its window
    reaches (none of the dropped ones), padded to the group's widest and masked."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    dtype = decode_dtype(kv_cache.dtype)
    device = query.device
    seq_lens = metadata.seq_lens_cpu
    first_block = [0] * len(seq_lens)
    spans = list(seq_lens)  # positions gathered per sequence, from its first block
    for b in decodes:
        if sliding_window is not None:
            first_block[b] = max(0, seq_lens[b] - sliding_window) // block_size
        spans[b] = seq_lens[b] - first_block[b] * block_size
    token_bytes = 2 * num_kv_heads * head_dim * kv_cache.element_size()
    for members in _decode_groups(decodes, spans, token_bytes):
        count = len(members)
        num_blocks = -(-max(spans[b] for b in members) // block_size)
        members_t = torch.tensor(members, device=device)
        firsts = torch.tensor([first_block[b] for b in members], device=device)
        columns = (firsts[:, None] + torch.arange(num_blocks, device=device)[None, :])
        columns = columns.clamp_(max=metadata.block_tables.shape[1] - 1)  # past the end: masked
        tables = metadata.block_tables.index_select(0, members_t).gather(1, columns)
        block_ids = tables.flatten().long()
        k = _gather(kv_cache[0], block_ids, count).to(dtype)
        v = _gather(kv_cache[1], block_ids, count).to(dtype)
        rows = torch.tensor([starts[b] for b in members], device=device)
        q = query.index_select(0, rows).to(dtype).reshape(count, num_kv_heads, group, head_dim)
        positions = firsts[:, None] * block_size + torch.arange(num_blocks * block_size, device=device)
        lens = torch.tensor([seq_lens[b] for b in members], device=device)[:, None]
        mask = positions < lens
        if sliding_window is not None:
            mask &= positions >= lens - sliding_window
        o = _attend(q, k, v, mask[:, None, None, :], scale, logits_soft_cap)
        out.index_copy_(0, rows, o.reshape(count, num_heads, head_dim).to(out.dtype))


def _prefill_windowed(query, kv_cache, metadata, scale, out, start, q_len, b, sliding_window,
                      logits_soft_cap) -> None:
    """One prefill chunk with a window and/or soft cap, PREFILL_QUERY_TILE queries at a time,
    each tile gathering the blocks from its first query's window to its last query."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    s_len = metadata.seq_lens_cpu[b]
    device = query.device
    tile = PREFILL_QUERY_TILE
    for first in range(0, q_len, tile):
        count = min(tile, q_len - first)
        q_pos0 = s_len - q_len + first  # position of the tile's first query
        lo = 0 if sliding_window is None else max(0, q_pos0 - sliding_window + 1) // block_size
        hi = -(-(q_pos0 + count) // block_size)
        block_ids = metadata.block_tables[b, lo:hi].long()
        k = _gather(kv_cache[0], block_ids, 1).float()  # [1, kv_heads, n, d]
        v = _gather(kv_cache[1], block_ids, 1).float()
        q = query[start + first:start + first + count].float().transpose(0, 1)  # [heads, count, d]
        q = q.reshape(1, num_kv_heads, group * count, head_dim)  # a KV head's queries, head-major
        q_pos = torch.arange(q_pos0, q_pos0 + count, device=device)[:, None]
        k_pos = torch.arange(lo * block_size, hi * block_size, device=device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        o = _attend(q, k, v, mask.repeat(group, 1), scale, logits_soft_cap)  # [1, kv, group*count, d]
        o = o.reshape(num_heads, count, head_dim).transpose(0, 1)
        out[start + first:start + first + count] = o.to(out.dtype)
