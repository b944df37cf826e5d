"""Pooling hidden states into sentence embeddings (the modes and records: `core/pooling.py`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.replicas.core.pooling import PoolingConfig


def pool(hidden, seq_starts: list[int], config: PoolingConfig):
    """hidden [T, H] of packed sequences (sequence i: rows seq_starts[i]:seq_starts[i+1]) ->
    [num_seqs, H] float32 embeddings."""
    hidden = hidden.float()
    starts = torch.tensor(seq_starts, dtype=torch.int64, device=hidden.device)
    lengths = starts[1:] - starts[:-1]
    mode = config.mode
    if mode == "cls":
        pooled = hidden[starts[:-1]]
    elif mode == "last":
        pooled = hidden[starts[1:] - 1]
    elif mode == "max":
        pooled = torch.stack([hidden[s:e].amax(0) for s, e in zip(seq_starts[:-1], seq_starts[1:])])
    else:  # a segment sum over the packed rows: one index_add, no padding
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device),
                                               lengths)
        sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, seq_of_token, hidden)
        divisor = lengths if mode == "mean" else lengths.float().sqrt()
        pooled = sums / divisor.unsqueeze(1).to(sums.dtype)
    return F.normalize(pooled, p=2, dim=1) if config.normalize else pooled


class PromptPooler:
    """A decoder's pooling requests, in the model runner: their prompts' final hidden states are
    pooled as the chunks of the prompt run (chunked prefill spreads one prompt over several
    steps), and each is done in the step that reaches the prompt's end."""

    def __init__(self):
        self._sums: dict[int, object] = {}  # seq_id -> float32 sum of its rows so far ("mean")

    def update(self, scheduled, hidden, query_start_loc) -> dict[int, list[float]]:
        """scheduled: the step's ScheduledSeqs; hidden [T, H] their packed rows -> the embeddings
        (normalized) of the pooling sequences whose prompt ended this step, by seq_id."""
        done = {}
        for i, item in enumerate(scheduled):
            seq = item.seq
            mode = seq.sampling_params.pooling
            if mode is None:
                continue
            if item.start == 0:  # first chunk, or a preempted sequence recomputing from 0
                self._sums.pop(seq.seq_id, None)
            first = int(query_start_loc[i])
            rows = hidden[first:first + item.num_new_tokens].float()
            if mode == "mean":
                total = rows.sum(0)
                previous = self._sums.get(seq.seq_id)
                self._sums[seq.seq_id] = total if previous is None else previous + total
            if not item.samples:
                continue
            if mode == "last":
                pooled = rows[-1]
            else:
                pooled = self._sums.pop(seq.seq_id) / seq.num_prompt_tokens
            done[seq.seq_id] = F.normalize(pooled, dim=0).tolist()
        return done

    def release(self, seq_id: int) -> None:
        self._sums.pop(seq_id, None)
