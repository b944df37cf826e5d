"""Logit processors that rewrite logits before sampling: logit_bias, min_tokens, penalties.

Each works in place on the rows that ask for it and leaves the other rows bit-for-bit untouched,
so a row's result never depends on what else is in the batch.
"""
from __future__ import annotations

import torch

from pagedserve.replicas.core.sequence import Sequence


def has_penalties(seq: Sequence) -> bool:
    p = seq.sampling_params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def min_tokens_active(seq: Sequence) -> bool:
    return seq.num_output_tokens < seq.sampling_params.min_tokens


def stop_token_ids(seq: Sequence) -> set[int]:
    """Ids that would end `seq` now: stop_token_ids, plus eos (the sequence's and the model's
    `eos_token_ids`) unless ignore_eos."""
    p = seq.sampling_params
    ids = set(p.stop_token_ids)
    if not p.ignore_eos:
        ids.update(getattr(p, "eos_token_ids", None) or ())
        if seq.eos_token_id is not None:
            ids.add(seq.eos_token_id)
    return ids


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Add each row's logit_bias (token id -> bias); ids outside the vocabulary are ignored."""
    vocab_size = logits.shape[1]
    rows, cols, biases = [], [], []
    for i, seq in enumerate(seqs):
        for token_id, bias in (seq.sampling_params.logit_bias or {}).items():
            token_id = int(token_id)
            if 0 <= token_id < vocab_size:
                rows.append(i)
                cols.append(token_id)
                biases.append(float(bias))
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device),
                          accumulate=True)


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Forbid eos and the stop token ids while a sequence has fewer than min_tokens outputs."""
    vocab_size = logits.shape[1]
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        if min_tokens_active(seq):
            for token_id in stop_token_ids(seq):
                if 0 <= token_id < vocab_size:
                    rows.append(i)
                    cols.append(token_id)
    if rows:
        logits[torch.tensor(rows, device=logits.device),
               torch.tensor(cols, device=logits.device)] = float("-inf")


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition (prompt + output tokens, HF/vLLM), then frequency and presence (output tokens
    only, OpenAI).

    Each reads and rewrites only the logits of the tokens a row has seen: gathered through the
    row's token list, rewritten, put back (a token listed twice is written twice, with the same
    value): dense [rows, vocab] passes cost a large share of a decode step on a big vocabulary
    (bench/sampler.py times both). For a row, a neutral penalty is an exact no-op, so rows are
    taken only where theirs is not neutral.
    """
    repetition = [(i, seq.token_ids) for i, seq in enumerate(seqs)
                  if seq.sampling_params.repetition_penalty != 1.0]
    table = _token_table(logits, repetition)
    if table is not None:
        rows, tokens, _, kept = table
        factor = _column(logits, [seqs[i].sampling_params.repetition_penalty for i in kept])
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / factor, values * factor)
    counted = [(i, seq.output_token_ids) for i, seq in enumerate(seqs)
               if (seq.sampling_params.frequency_penalty, seq.sampling_params.presence_penalty) != (0.0, 0.0)]
    table = _token_table(logits, counted)
    if table is not None:
        rows, tokens, listed, kept = table
        params = [seqs[i].sampling_params for i in kept]
        values = logits[rows, tokens]
        if any(p.frequency_penalty != 0.0 for p in params):
            counts = torch.zeros(len(kept), logits.shape[1], dtype=logits.dtype, device=logits.device)
            counts = counts.scatter_add_(1, tokens, listed.to(logits.dtype)).gather(1, tokens)
            values = values - _column(logits, [p.frequency_penalty for p in params]) * counts
        if any(p.presence_penalty != 0.0 for p in params):
            values = values - _column(logits, [p.presence_penalty for p in params])
        logits[rows, tokens] = values


def _column(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]


def _token_table(logits: torch.Tensor, lists: list[tuple[int, list[int]]]):
    """[(row of logits, its token ids)] -> (rows [M, 1], tokens [M, L], listed [M, L], the rows
    kept), or None: ids outside the vocabulary are dropped, lists left with none are dropped, and
    each list is padded with its own first id (listed False there)."""
    if not lists:
        return None
    device, vocab_size = logits.device, logits.shape[1]
    width = max(len(ids) for _, ids in lists)
    tokens = torch.tensor([ids + [-1] * (width - len(ids)) for _, ids in lists], dtype=torch.long)
    listed = (tokens >= 0) & (tokens < vocab_size)
    keep = listed.any(dim=1)
    if not bool(keep.any()):
        return None
    first = tokens.gather(1, listed.int().argmax(dim=1, keepdim=True))
    tokens = torch.where(listed, tokens, first)
    kept = [row for (row, _), k in zip(lists, keep.tolist()) if k]
    if len(kept) < len(lists):
        tokens, listed = tokens[keep], listed[keep]
    rows = torch.tensor(kept, device=device)[:, None]
    return rows, tokens.to(device), listed.to(device), kept
