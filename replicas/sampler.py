"""Turns one engine step's logits into one token per sequence (plus logprobs when asked).

Order, as in vLLM: raw logprobs → logit_bias → min_tokens → penalties → greedy argmax, or
temperature → min_p → top_k / top_p → random sample. Every filter touches only the rows that
asked for it, and seeded rows draw their noise from their own generator, so a row's token never
depends on the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.logprobs import gather_logprobs
from replicas.outputs import PositionLogprobs
from replicas.penalties import (apply_logit_bias, apply_min_tokens, apply_penalties,
                                has_penalties, min_tokens_active)
from replicas.sequence import Sequence

_SEED_MASK = (1 << 64) - 1


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # None where the sequence did not ask


def _is_plain_greedy(seq: Sequence) -> bool:
    p = seq.sampling_params
    return (p.temperature == 0.0 and p.logprobs is None and not p.logit_bias
            and not has_penalties(seq) and not min_tokens_active(seq))


class Sampler:
    """`sampler(logits [N, V], seqs) -> SamplerOutput`; row i of logits belongs to seqs[i].

    Pass only rows that produce a token this step (not a partial prefill chunk): a seeded row
    advances its generator on every call. `logits` may be modified in place.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generators: dict[int, torch.Generator] = {}

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence (not a preempted one: its draws continue)."""
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} sequences")
        if all(_is_plain_greedy(seq) for seq in seqs):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(seqs))

        logprob_rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw = logits if len(logprob_rows) == len(seqs) else logits[logprob_rows]
            raw_logprobs = torch.log_softmax(raw.float(), dim=-1)

        logits = logits.float()
        apply_logit_bias(logits, seqs)
        apply_min_tokens(logits, seqs)
        apply_penalties(logits, seqs)
        sampled = self._sample(logits, seqs)

        logprobs: list[PositionLogprobs | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            chosen = sampled[logprob_rows] if len(logprob_rows) != len(seqs) else sampled
            num_logprobs = [seqs[i].sampling_params.logprobs for i in logprob_rows]
            for i, position in zip(logprob_rows, gather_logprobs(raw_logprobs, chosen, num_logprobs)):
                logprobs[i] = position
        return SamplerOutput(sampled.tolist(), logprobs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        random_rows = [i for i, seq in enumerate(seqs) if not seq.sampling_params.is_greedy]
        if not random_rows:
            return logits.argmax(dim=-1)
        all_random = len(random_rows) == len(seqs)
        chosen = seqs if all_random else [seqs[i] for i in random_rows]
        x = logits if all_random else logits[random_rows]
        temperature = [seq.sampling_params.temperature for seq in chosen]
        x.div_(torch.tensor(temperature, dtype=x.dtype, device=x.device)[:, None])
        _apply_min_p(x, chosen)
        _apply_top_k_top_p(x, chosen)
        probs = x.softmax(dim=-1)
        random_sampled = probs.div_(self._exponential_noise(probs, chosen)).argmax(dim=-1)
        if all_random:
            return random_sampled
        sampled = logits.argmax(dim=-1)
        sampled[torch.tensor(random_rows, device=sampled.device)] = random_sampled
        return sampled

    def _exponential_noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """q ~ Exp(1) per entry; argmax(probs / q) is a sample from probs (the Gumbel-max trick)."""
        q = torch.empty_like(probs)
        seeded = [(i, seq) for i, seq in enumerate(seqs) if seq.sample_seed is not None]
        if len(seeded) < len(seqs):
            q.exponential_()
        for i, seq in seeded:
            q[i].exponential_(generator=self._generator(seq))
        # Exp(1) can return exactly 0: 0/0 would be NaN, which argmax would pick.
        return q.clamp_(min=torch.finfo(q.dtype).tiny)

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.sample_seed & _SEED_MASK)
            self._generators[seq.seq_id] = generator
        return generator


def _apply_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """vLLM: drop tokens whose probability is below min_p × the top token's probability."""
    rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.min_p > 0.0]
    if not rows:
        return
    _update_rows(logits, rows, lambda x: _min_p(
        x, torch.tensor([seqs[i].sampling_params.min_p for i in rows], device=x.device)))


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None].to(probs.dtype)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Rows with top_p < 1 take vLLM's sort path (top_k and top_p together); rows with only top_k
    take a cheaper topk threshold. Which path a row takes depends only on its own settings."""
    vocab_size = logits.shape[1]
    top_p_rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.top_p < 1.0]
    top_k_rows = [i for i, seq in enumerate(seqs)
                  if seq.sampling_params.top_p >= 1.0 and 0 < seq.sampling_params.top_k < vocab_size]

    def top_k(rows: list[int]) -> torch.Tensor:
        k = [min(seqs[i].sampling_params.top_k or vocab_size, vocab_size) for i in rows]
        return torch.tensor(k, dtype=torch.long, device=logits.device)

    if top_p_rows:
        top_p = torch.tensor([seqs[i].sampling_params.top_p for i in top_p_rows], device=logits.device)
        _update_rows(logits, top_p_rows, lambda x: _top_k_top_p_sorted(x, top_k(top_p_rows), top_p))
    if top_k_rows:
        _update_rows(logits, top_k_rows, lambda x: _top_k_only(x, top_k(top_k_rows)))


def _top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep every token at least as large as the k-th largest (ties at the threshold all stay)."""
    top_values = logits.topk(int(k.max()), dim=-1).values
    threshold = top_values.gather(1, (k - 1)[:, None])
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's apply_top_k_top_p: sort ascending, mask below the k-th largest, then mask the low
    tail whose cumulative probability is at most 1 - p (always keeping the top token)."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    threshold = logits_sort.gather(1, (logits_sort.shape[1] - k)[:, None])
    logits_sort.masked_fill_(logits_sort < threshold, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
    top_p_mask = probs_sum <= 1 - p[:, None].to(probs_sum.dtype)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _update_rows(logits: torch.Tensor, rows: list[int], fn) -> None:
    """logits[rows] = fn(logits[rows]), without a copy when every row takes part."""
    if len(rows) == logits.shape[0]:
        out = fn(logits)
        if out is not logits:
            logits.copy_(out)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = fn(logits[index])
