"""Logprobs of chosen tokens plus the top-k, vLLM-shaped: {token_id: Logprob(logprob, rank)}.

Ranks are 1-based over the whole vocabulary: a chosen token's rank is the number of tokens whose
logprob is at least its own (so ties rank it last among equals, as vLLM does); the top-k get
ranks 1..k by position. `decoded_token` is left None: the engine fills it.
"""
from __future__ import annotations

import torch

from pagedserve.replicas.core.outputs import Logprob, PositionLogprobs

# Rows of prompt logits turned into logprobs at a time: bounds the [rows, V] temporaries.
PROMPT_LOGPROBS_CHUNK = 256


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_logprobs: list[int]) -> list[PositionLogprobs]:
    """For each row of `logprobs` [M, V]: the chosen token first, then its top `num_logprobs[i]`.

    A chosen token that is also in the top-k keeps its first (chosen) entry.
    """
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long)[:, None]
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=1)
    max_k = max(num_logprobs, default=0)
    if max_k > 0:
        top_logprobs, top_ids = logprobs.topk(min(max_k, logprobs.shape[1]), dim=1)
        top_logprobs, top_ids = top_logprobs.tolist(), top_ids.tolist()
    chosen = zip(token_ids[:, 0].tolist(), token_logprobs[:, 0].tolist(), ranks.tolist())
    results = []
    for i, (token_id, logprob, rank) in enumerate(chosen):
        position = {token_id: Logprob(logprob, rank)}
        for r in range(min(num_logprobs[i], len(top_ids[i])) if max_k > 0 else 0):
            position.setdefault(top_ids[i][r], Logprob(top_logprobs[i][r], r + 1))
        results.append(position)
    return results


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int],
                            k: int) -> list[PositionLogprobs]:
    """Row p of `logits` [P, V] predicts `next_token_ids[p]`: that token's logprob, then the top-k.

    Computed from the raw logits (no penalties or temperature), in chunks of rows to bound memory.
    The first prompt token has no logprob; the caller puts None before these.
    """
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(next_token_ids)} tokens")
    results: list[PositionLogprobs] = []
    for start in range(0, len(next_token_ids), PROMPT_LOGPROBS_CHUNK):
        stop = start + PROMPT_LOGPROBS_CHUNK
        logprobs = torch.log_softmax(logits[start:stop].float(), dim=-1)
        ids = torch.tensor(next_token_ids[start:stop], dtype=torch.long, device=logits.device)
        results.extend(gather_logprobs(logprobs, ids, [k] * len(ids)))
    return results
