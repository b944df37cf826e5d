"""Logit processors that rewrite logits before sampling: logit_bias, min_tokens, penalties.

Each works in place on the rows that ask for it and leaves the other rows bit-for-bit untouched,
so a row's result never depends on what else is in the batch.
"""
from __future__ import annotations

import torch

from replicas.sequence import Sequence


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

    The token lists of the rows that need penalties are padded into one [M, L] tensor with the
    pad id `vocab_size`; counts are scatter-ed into [M, V + 1] and the pad column dropped. A
    penalty no chosen row uses is skipped (for a row, a neutral penalty is an exact no-op).
    """
    rows = [i for i, seq in enumerate(seqs) if has_penalties(seq)]
    if not rows:
        return
    device, (num_rows, vocab_size) = logits.device, logits.shape
    chosen = [seqs[i] for i in rows]
    max_len = max(seq.num_tokens for seq in chosen)
    table = [seq.token_ids + [vocab_size] * (max_len - seq.num_tokens) for seq in chosen]
    tokens = torch.tensor(table, dtype=torch.long, device=device).clamp_(0, vocab_size)

    def column(name: str) -> torch.Tensor | None:
        values = [float(getattr(seq.sampling_params, name)) for seq in chosen]
        if all(v == (1.0 if name == "repetition_penalty" else 0.0) for v in values):
            return None
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]

    all_rows = len(rows) == num_rows
    index = None if all_rows else torch.tensor(rows, device=device)
    sub = logits if all_rows else logits[index]
    repetition = column("repetition_penalty")
    if repetition is not None:
        seen = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, tokens, True)
        factor = torch.where(seen[:, :vocab_size], repetition, 1.0)
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    frequency, presence = column("frequency_penalty"), column("presence_penalty")
    if frequency is not None or presence is not None:
        prompt_lens = torch.tensor([seq.num_prompt_tokens for seq in chosen], device=device)
        is_output = torch.arange(max_len, device=device)[None, :] >= prompt_lens[:, None]
        counts = torch.zeros(len(rows), vocab_size + 1, dtype=logits.dtype, device=device)
        counts = counts.scatter_add_(1, tokens, is_output.to(logits.dtype))[:, :vocab_size]
        if frequency is not None:
            sub = sub - frequency * counts
        if presence is not None:
            sub = sub - presence * (counts > 0).to(logits.dtype)
    if all_rows:
        logits.copy_(sub)
    else:
        logits[index] = sub
