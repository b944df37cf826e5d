"""Triton kernels for the paged KV cache: store, decode (plain and split-K), prefill.

Cache layout (see kernels/metadata.py): [2, num_blocks, block_size, num_kv_heads, head_dim].
Every kernel reads K/V one tile of TILE_N context positions at a time and finds each position's
physical row through the block table, so TILE_N (a tl.dot-able power of two) is independent of
block_size: any block size works, including ones smaller than 16.

Softmax runs in the log2 domain (exp2 is the hardware instruction): scores are scaled by
scale * log2(e), and a split's log-sum-exp is kept in log2 units too.

HAS_WINDOW and HAS_SOFT_CAP are compile-time switches, so the plain causal kernels are unchanged.
With a sliding window the K/V loops start at the first tile some query's window reaches and the
loads are masked to the window, so block-table entries older than it (dropped blocks) are never
read. A prefill row may see nothing in a tile, so the window path guards its running max.
The soft cap c works in log2 units too: soft_cap_log2 = c * log2(e), s = soft_cap_log2 *
tanh(s / soft_cap_log2), which equals log2(e) * c * tanh(scale * q.k / c).

Arithmetic is float32 except the two tl.dot inputs, which are COMPUTE_DTYPE: the storage dtype for
fp16/bf16 on a GPU (tensor cores, fp32 accumulation), float32 for fp32 storage (with IEEE
precision, not TF32) and always under TRITON_INTERPRET=1, whose bf16 arithmetic is wrong.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def store_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
                    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                    stride_cache_kv, stride_cache_block, stride_cache_pos, stride_cache_head,
                    num_kv_heads, head_dim,
                    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per new token: copy its K and V rows (all KV heads) into its cache slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token (slot -1) has no place in the cache
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_pos
           + h * stride_cache_head + d)
    key = tl.load(key_ptr + token * stride_key_token + h * stride_key_head + d, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + h * stride_value_head + d, mask=mask)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_offsets(block_table_ptr, pos, pos_mask, kv_head,
                stride_cache_block, stride_cache_pos, stride_cache_head, BLOCK_SIZE: tl.constexpr):
    """Element offsets of the K rows at context positions `pos` (V is stride_cache_kv further)."""
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    return block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_pos + kv_head * stride_cache_head


@triton.jit
def _tanh(x):
    """tanh from exp2 (the interpreter and every GPU have it): 1 - 2 / (e^2x + 1), saturating."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _load_kv_tile(cache_ptr, stride_cache_kv, offsets, d, kv_mask, COMPUTE_DTYPE: tl.constexpr):
    """One tile of K and V (rows at `offsets`), loaded and cast to the compute dtype."""
    k = tl.load(cache_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
    v = tl.load(cache_ptr + stride_cache_kv + offsets[:, None] + d[None, :], mask=kv_mask,
                other=0.0).to(COMPUTE_DTYPE)
    return k, v


@triton.jit
def decode_kernel(out_ptr, partial_out_ptr, partial_lse_ptr,
                  query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                  qk_scale,
                  stride_query_token, stride_query_head, stride_out_token, stride_out_head,
                  stride_cache_kv, stride_cache_block, stride_cache_pos, stride_cache_head,
                  stride_block_table, num_heads, sliding_window, soft_cap_log2,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr):
    """Grid (num_seqs, num_kv_heads, NUM_SPLITS). One program: all GROUP query heads that share one
    KV head (so each K/V tile is read once for the group), over split `program_id(2)` of the context.

    NUM_SPLITS == 1 writes the normalized output. Otherwise (flash-decoding, for long contexts and
    few programs) each split writes its normalized partial output and log2-sum-exp, and
    reduce_splits_kernel combines them.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - row != 1:  # prefill chunks: prefill_kernel's job
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    if HAS_WINDOW:  # the query at seq_len - 1 sees positions seq_len - window .. seq_len - 1
        window_start = tl.maximum(seq_len - sliding_window, 0)
        start_tile = window_start // TILE_N
        tiles_per_split = tl.cdiv(num_tiles - start_tile, NUM_SPLITS)
        first_tile = start_tile + split * tiles_per_split
    else:
        window_start = 0
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    # The group's query heads are padded to BLOCK_G rows (>= 16, the smallest tl.dot tile).
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(query_ptr + row * stride_query_token + head[:, None] * stride_query_head + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE_DTYPE)

    block_table_ptr = block_tables_ptr + seq * stride_block_table
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max score (log2 units)
    l = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, TILE_N)
    for tile in range(first_tile, last_tile):
        pos = tile * TILE_N + n
        pos_mask = pos < seq_len
        if HAS_WINDOW:
            pos_mask = pos_mask & (pos >= window_start)
        offsets = _kv_offsets(block_table_ptr, pos, pos_mask, kv_head,
                              stride_cache_block, stride_cache_pos, stride_cache_head, BLOCK_SIZE)
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k, v = _load_kv_tile(cache_ptr, stride_cache_kv, offsets, d, kv_mask, COMPUTE_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if HAS_SOFT_CAP:
            s = soft_cap_log2 * _tanh(s / soft_cap_log2)
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds at least one position
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=PRECISION)
        m = m_new

    # A split past the end of a short context saw nothing: l == 0, output 0, weight exp2(-inf) = 0.
    safe_l = tl.where(l > 0, l, 1.0)
    out = acc / safe_l[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row * stride_out_token + head[:, None] * stride_out_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        partial = (seq * num_heads + head) * NUM_SPLITS + split  # [num_seqs, num_heads, NUM_SPLITS]
        tl.store(partial_out_ptr + partial[:, None] * BLOCK_D + d[None, :], out, mask=out_mask)
        lse = tl.where(l > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(partial_lse_ptr + partial, lse, mask=g_mask)


@triton.jit
def reduce_splits_kernel(out_ptr, partial_out_ptr, partial_lse_ptr, query_start_loc_ptr,
                         stride_out_token, stride_out_head, num_heads,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (num_seqs, num_heads): out = sum_i w_i * out_i / sum_i w_i with w_i = 2^(lse_i - max lse)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - row != 1:
        return
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    partial = (seq * num_heads + head) * NUM_SPLITS + s
    lse = tl.load(partial_lse_ptr + partial, mask=s_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 always saw tokens, so the max is finite
    parts = tl.load(partial_out_ptr + partial[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + row * stride_out_token + head * stride_out_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def prefill_kernel(out_ptr, query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                   qk_scale,
                   stride_query_token, stride_query_head, stride_out_token, stride_out_head,
                   stride_cache_kv, stride_cache_block, stride_cache_pos, stride_cache_head,
                   stride_block_table, sliding_window, soft_cap_log2,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
                   COMPUTE_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr):
    """Grid (num_seqs, cdiv(max_query_len, BLOCK_M), num_heads). One program: BLOCK_M consecutive
    query tokens of one sequence's chunk, one query head. The chunk is the last query_len tokens of
    the context, so query i sits at position seq_len - query_len + i and sees keys 0..that position
    (the cached prefix and the chunk so far), all read from the paged cache (store_kv runs first).
    """
    seq = tl.program_id(0)
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    row0 = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - row0
    # Decodes are decode_kernel's job; tiles past a shorter chunk's end have nothing to do.
    if query_len == 1 or m_tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    i = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < query_len
    q_pos = seq_len - query_len + i
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(query_ptr + (row0 + i)[:, None] * stride_query_token + head * stride_query_head + d[None, :],
                mask=i_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE_DTYPE)

    block_table_ptr = block_tables_ptr + seq * stride_block_table
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, TILE_N)
    # Keys past this tile's last query position are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, seq_len - query_len + (m_tile + 1) * BLOCK_M)
    if HAS_WINDOW:  # and keys before the tile's first query's window, for every row too
        window_start = tl.maximum(seq_len - query_len + m_tile * BLOCK_M - sliding_window + 1, 0)
        kv_start = window_start // TILE_N * TILE_N
    else:
        window_start = 0
        kv_start = 0
    for start in range(kv_start, kv_end, TILE_N):
        pos = start + n
        pos_mask = pos < kv_end
        if HAS_WINDOW:
            pos_mask = pos_mask & (pos >= window_start)
        offsets = _kv_offsets(block_table_ptr, pos, pos_mask, kv_head,
                              stride_cache_block, stride_cache_pos, stride_cache_head, BLOCK_SIZE)
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k, v = _load_kv_tile(cache_ptr, stride_cache_kv, offsets, d, kv_mask, COMPUTE_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if HAS_SOFT_CAP:
            s = soft_cap_log2 * _tanh(s / soft_cap_log2)
        # Causal with the chunk's offset. Without a window, position 0 is visible to every row
        # (padding rows too), so no row is ever all -inf and m stays finite after the first tile.
        visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - pos[None, :] < sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        if HAS_WINDOW:  # a row that has seen nothing yet keeps m = -inf: subtract 0 instead
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=PRECISION)
        m = m_new

    if HAS_WINDOW:  # padding rows may have seen nothing
        l = tl.where(l > 0, l, 1.0)
    out = acc / l[:, None]
    tl.store(out_ptr + (row0 + i)[:, None] * stride_out_token + head * stride_out_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=i_mask[:, None] & d_mask[None, :])
