"""Pure-torch paged attention and KV store, and the value of a quantized weight: the spec every
other backend and kernel must match.

Written for clarity, one sequence at a time, computing in float32.

Two per-layer options, both None by default (plain causal attention):
- sliding_window W (transformers' semantics): the query at position i attends to key j iff
  j <= i and i - j < W. Keys older than every query's window are never read, so their block-table
  entries may be placeholders (the block manager drops such blocks).
- logits_soft_cap c (Gemma 2): scores = c * tanh(scores / c) after scaling, before the mask.
"""
from __future__ import annotations

import torch

from pagedserve.kernels.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> their slots in kv_cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0, slot_mapping] = key.to(kv_cache.dtype)
    flat[1, slot_mapping] = value.to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached K and V of positions first..seq_len-1 of one sequence: [seq_len - first,
    num_kv_heads, head_dim] each. Blocks wholly before `first` are not read."""
    block_size = kv_cache.shape[2]
    first_block = first // block_size
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[first_block:num_blocks].long()]  # [2, nb, bs, h, d]
    blocks = blocks.flatten(1, 2)[:, first - first_block * block_size:seq_len - first_block * block_size]
    return blocks[0], blocks[1]


def first_key_position(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """The oldest position any of the sequence's queries attends to."""
    if sliding_window is None:
        return 0
    return max(0, seq_len - query_len - sliding_window + 1)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> output of the same shape and dtype."""
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for b in range(metadata.num_seqs):
        start = int(metadata.query_start_loc[b])
        q_len = metadata.query_lens_cpu[b]
        s_len = metadata.seq_lens_cpu[b]
        first = first_key_position(s_len, q_len, sliding_window)
        k, v = gather_kv(kv_cache, metadata.block_tables[b], s_len, first)
        k = k.float().repeat_interleave(group, dim=1)  # [s, h, d]
        v = v.float().repeat_interleave(group, dim=1)
        q = query[start:start + q_len].float()  # [q, h, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(s_len - q_len, s_len, device=query.device)[:, None]
        k_pos = torch.arange(first, s_len, device=query.device)[None, :]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= q_pos - k_pos >= sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def dequantize_weight(weight) -> torch.Tensor:
    """A pagedserve.kernels.quantized.QuantWeight -> its float32 [n, k] value, in input-channel order."""
    n, k = weight.shape
    values = weight.values().float().view(n, k // weight.group_size, weight.group_size)
    dense = (values * weight.scales.unsqueeze(-1) + weight.offsets.unsqueeze(-1)).view(n, k)
    if weight.perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, weight.perm] = dense
    return out


def quant_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] . dequantize_weight(weight)^T (+ bias), computed in float32, in x's dtype."""
    out = x.float() @ dequantize_weight(weight).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[g]:offsets[g + 1] of x [rows, k] times weights[g]^T ([groups, n, k]) ->
    [rows, n]: a mixture of experts' projection over its tokens sorted by expert."""
    out = x.new_empty(x.shape[0], weights.shape[1])
    for g, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        out[start:end] = x[start:end] @ weights[g].T
    return out


def sample_rows(logits: torch.Tensor, uniforms: torch.Tensor, scales: torch.Tensor | None = None
                ) -> torch.Tensor:
    """One token per row of logits [rows, n] from softmax(logits * scales[:, None]) (scales None:
    1), by inverse CDF at uniforms [rows] in [0, 1): the first index whose running sum of
    probabilities passes u times their total. Zero-probability entries are never taken: where
    rounding leaves the target past the end, the last entry of positive probability is. Float64."""
    x = logits.double()
    if scales is not None:
        x = x * scales.double()[:, None]
    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, uniforms.double()[:, None] * cdf[:, -1:], right=True)[:, 0]
    n = logits.shape[1]
    last_positive = n - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(index < n, index, last_positive)


def lora_delta_reference(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
                         lora_a: torch.Tensor, lora_b_t: torch.Tensor, ranks: torch.Tensor) -> None:
    """Batched multi-LoRA, in place: out[t] += (lora_a[s, :r] . x[t]) . lora_b_t[s, :r] for each
    row t with an adapter, s = token_slots[t] (-1: none, row untouched), r = ranks[s].

    x [T, K] and out [T, N] share a dtype; lora_a [S, R, K] and lora_b_t [S, R, N] (B transposed,
    the scaling folded in) share theirs; rows of a slot past its rank are never read. Computed in
    float32, out rounded once: out[t] = (out[t].float() + delta).to(out.dtype)."""
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        r = int(ranks[s])
        h = lora_a[s, :r].float() @ x[t].float()
        delta = h @ lora_b_t[s, :r].float()
        out[t] = (out[t].float() + delta).to(out.dtype)
