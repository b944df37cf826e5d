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
    """Ids that would end `seq` now: stop_token_ids, the engine's all_stop_token_ids, and eos."""
    p = seq.sampling_params
    ids = set(p.stop_token_ids) | p.all_stop_token_ids
    if seq.eos_token_id is not None and not p.ignore_eos:
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
    """Repetition (prompt + output tokens, HF/vLLM), then frequency and presence (output only, OpenAI).

    The token lists of the rows that need penalties are padded into one [M, L] tensor with the
    pad id `vocab_size`; counts are scatter_add-ed into [M, V + 1] and the pad column dropped.
    """
    rows = [i for i, seq in enumerate(seqs) if has_penalties(seq)]
    if not rows:
        return
    device, (num_rows, vocab_size) = logits.device, logits.shape
    chosen = [seqs[i] for i in rows]
    max_len = max(seq.num_tokens for seq in chosen)
    table = [seq.token_ids + [vocab_size] * (max_len - seq.num_tokens) for seq in chosen]
    tokens = torch.tensor(table, dtype=torch.long, device=device).clamp_(0, vocab_size)
    prompt_lens = torch.tensor([seq.num_prompt_tokens for seq in chosen], device=device)
    is_output = torch.arange(max_len, device=device)[None, :] >= prompt_lens[:, None]

    seen = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, tokens, True)
    output_counts = torch.zeros(len(rows), vocab_size + 1, dtype=logits.dtype, device=device)
    output_counts.scatter_add_(1, tokens, is_output.to(logits.dtype))
    seen, output_counts = seen[:, :vocab_size], output_counts[:, :vocab_size]

    def column(name: str) -> torch.Tensor:
        values = [float(getattr(seq.sampling_params, name)) for seq in chosen]
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]

    all_rows = len(rows) == num_rows
    index = None if all_rows else torch.tensor(rows, device=device)
    sub = logits if all_rows else logits[index]
    repetition = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - column("frequency_penalty") * output_counts
    sub = sub - column("presence_penalty") * (output_counts > 0).to(logits.dtype)
    if all_rows:
        logits.copy_(sub)
    else:
        logits[index] = sub
