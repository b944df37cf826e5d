"""Verifying drafts: one step's logits at a sequence's last token and at each of its drafts give
its next tokens, as many as were right, plus the one after them.

Every position is sampled exactly as a plain decode step would sample it, with the sequence as it
would stand had the drafts before it been accepted (its penalties, min_tokens, grammar state,
seeded generator), and the drafts are accepted while each equals the token sampled at its
position; the first that differs is replaced by that sampled token, and if all are accepted the
last position's token follows. Drafts here are single tokens (no draft distribution), so this is
the rejection sampler of speculative decoding with a one-hot draft: a draft is kept with the
target's probability of it, and a rejected position yields the target's distribution without it.
Because each emitted token is drawn at the uniform a plain step would have drawn for it (a seeded
sequence's generator is rewound past the positions not used), outputs are the same tokens with
or without speculation, greedy or seeded, whenever the logits are.
"""
from __future__ import annotations

import torch

from pagedserve.replicas.core.outputs import PositionLogprobs
from pagedserve.replicas.core.sequence import OutputTokens, Sequence
from pagedserve.replicas.structured.matcher import is_constrained


class DraftPosition(OutputTokens):
    """A sequence as it would stand after `drafts` were accepted: what the sampler reads of it."""

    __slots__ = ("seq_id", "sampling_params", "token_ids", "num_prompt_tokens", "eos_token_id",
                 "sample_seed", "grammar")

    def __init__(self, seq: Sequence, drafts: list[int]):
        self.seq_id = seq.seq_id
        self.sampling_params = seq.sampling_params
        self.token_ids = seq.token_ids + drafts if drafts else seq.token_ids
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.eos_token_id = seq.eos_token_id
        self.sample_seed = seq.sample_seed
        self.grammar = None  # its mask is applied before sampling (apply_grammars below)


def verify(sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
           ) -> tuple[list[list[int]], list[list[PositionLogprobs] | None]]:
    """logits: for each sequence in turn, len(drafts[i]) + 1 rows (its last token's, then each
    draft's). Returns each sequence's tokens (accepted drafts, then one more) and, where it asked,
    their logprobs."""
    starts, rows = [], []
    for seq, seq_drafts in zip(seqs, drafts, strict=True):
        starts.append(len(rows))
        keep_self = not is_constrained(seq)
        rows.append(seq if keep_self else DraftPosition(seq, []))
        rows += [DraftPosition(seq, seq_drafts[:j]) for j in range(1, len(seq_drafts) + 1)]
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} positions")
    constrained = [i for i, seq in enumerate(seqs) if is_constrained(seq)]
    if constrained:
        apply_grammars(sampler, logits, [seqs[i] for i in constrained],
                       [drafts[i] for i in constrained], [starts[i] for i in constrained])
    # A seeded sequence's generator is rewound to where a plain step would leave it.
    rewind = {}
    for seq, seq_drafts in zip(seqs, drafts):
        if seq_drafts and seq.sample_seed is not None and not seq.sampling_params.is_greedy:
            rewind[seq.seq_id] = sampler._generator(seq).get_state()
    sampled = sampler(logits, rows)
    tokens_out, logprobs_out = [], []
    for i, (seq, seq_drafts) in enumerate(zip(seqs, drafts)):
        start = starts[i]
        tokens = []
        for j in range(len(seq_drafts) + 1):
            token = sampled.sampled_token_ids[start + j]
            tokens.append(token)
            if j == len(seq_drafts) or token != seq_drafts[j]:
                break
        tokens_out.append(tokens)
        logprobs_out.append(sampled.logprobs[start:start + len(tokens)]
                            if seq.sampling_params.logprobs is not None else None)
        state = rewind.get(seq.seq_id)
        if state is not None and len(tokens) < len(seq_drafts) + 1:
            generator = sampler._generator(seq)
            generator.set_state(state)
            for _ in tokens:  # the draws of the positions used, as the sampler made them
                torch.rand(1, dtype=torch.float64, device=sampler.device, generator=generator)
    return tokens_out, logprobs_out


def apply_grammars(sampler, logits: torch.Tensor, seqs: list[Sequence],
                   drafts: list[list[int]], starts: list[int]) -> None:
    """Mask each constrained sequence's rows with its grammar as it stands at that position: the
    matcher consumes the drafts one at a time between masks, then rolls them back (the engine
    advances it by the tokens accepted)."""
    bitmask = sampler.bitmask(logits.shape[1])
    consumed = [0] * len(seqs)
    for j in range(max(len(d) for d in drafts) + 1):
        at = [i for i, d in enumerate(drafts) if j <= len(d)]
        bitmask.apply(logits, [starts[i] + j for i in at], [seqs[i].grammar.matcher for i in at],
                      [seqs[i].grammar.opening_token for i in at] if j == 0 else None)
        for i in at:
            matcher = seqs[i].grammar.matcher
            # Once the grammar has ended it takes nothing more: the later rows keep its end's
            # mask, and the engine stops the sequence at the end before reaching them.
            if j < len(drafts[i]) and consumed[i] == j and not matcher.is_stopped():
                if not matcher.consume_token(drafts[i][j]):
                    raise RuntimeError("a draft the grammar had validated broke it")
                consumed[i] += 1
    for seq, count in zip(seqs, consumed):
        if count and not seq.grammar.matcher.rollback(count):
            raise RuntimeError(f"the grammar could not take back {count} drafts")
