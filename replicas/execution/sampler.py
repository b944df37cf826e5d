"""Turns one engine step's logits into one token per sequence (plus logprobs when asked).

Order, as in vLLM: grammar mask (structured outputs: constrained rows only) → raw logprobs →
logit_bias → min_tokens → penalties → greedy argmax, or temperature → min_p → top_k / top_p →
random sample. Every filter touches only the rows that asked for it. A random row's token is
drawn by inverse CDF at one uniform per row and step, and seeded rows draw it from their own
generator, so a row's token never depends on the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import native_argmax, native_sample, reference
from pagedserve.replicas.execution.logprobs import compute_prompt_logprobs, gather_logprobs
from pagedserve.replicas.core.outputs import PositionLogprobs
from pagedserve.replicas.execution.penalties import (
    apply_logit_bias, apply_min_tokens, apply_penalties, has_penalties, min_tokens_active,
)
from pagedserve.replicas.core.sequence import Sequence
from pagedserve.replicas.execution.verify import verify
from pagedserve.replicas.structured.matcher import is_constrained

__all__ = ["Sampler", "SamplerOutput", "compute_prompt_logprobs"]

_SEED_MASK = (1 << 64) - 1
# Tokens a top_p row looks at, tier after tier, before falling back to a full sort of its
# vocabulary: at a usual top_p most rows fit in the first tier, and a top-k of the second still
# costs a fraction of the sort (bench/sampler.py).
TOP_P_CANDIDATES = (256, 4096)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # None where the sequence did not ask


def _is_plain_greedy(seq: Sequence) -> bool:
    p = seq.sampling_params
    return p.is_greedy and p.logprobs is None and not _edits_logits(seq)


class Sampler:
    """`sampler(logits [N, V], seqs) -> SamplerOutput`; row i of logits belongs to seqs[i].

    Pass only rows that produce a token this step (not a partial prefill chunk): a seeded row
    advances its generator on every call. `logits` may be modified in place.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 max_num_seqs: int = 256) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self._generators: dict[int, torch.Generator] = {}
        self._bitmask = None  # a TokenBitmask, made when the first constrained row comes

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence (not a preempted one: its draws continue)."""
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} sequences")
        constrained = [i for i, seq in enumerate(seqs) if is_constrained(seq)]
        if constrained:
            self._apply_grammars(logits, seqs, constrained)
        if all(_is_plain_greedy(seq) for seq in seqs):
            return SamplerOutput(_argmax(logits).tolist(), [None] * len(seqs))

        logprob_rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw = logits if len(logprob_rows) == len(seqs) else logits[logprob_rows]
            raw_logprobs = torch.log_softmax(raw.float(), dim=-1)

        if logits.dtype is not torch.float32 and any(_edits_logits(seq) for seq in seqs):
            logits = logits.float()  # the edits below are made in fp32; the draws read bf16 as is
        apply_logit_bias(logits, seqs)
        apply_min_tokens(logits, seqs)
        apply_penalties(logits, seqs)
        sampled = self._sample(logits, seqs)

        logprobs: list[PositionLogprobs | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            chosen = sampled[logprob_rows] if len(logprob_rows) != len(seqs) else sampled
            num_logprobs = [seqs[i].sampling_params.logprobs for i in logprob_rows]
            positions = gather_logprobs(raw_logprobs, chosen, num_logprobs)
            for i, position in zip(logprob_rows, positions):
                logprobs[i] = position
        return SamplerOutput(sampled.tolist(), logprobs)

    def verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
               ) -> tuple[list[list[int]], list[list[PositionLogprobs] | None]]:
        """Each sequence's accepted drafts and the token after them, from logits at its last
        token and at each draft (replicas/execution/verify.py)."""
        return verify(self, logits, seqs, drafts)

    def bitmask(self, vocab_size: int):
        """The TokenBitmask constrained rows are masked with, made when the first one comes."""
        if self._bitmask is None:
            from pagedserve.replicas.structured.bitmask import TokenBitmask
            self._bitmask = TokenBitmask(self.max_num_seqs, vocab_size, self.device)
        return self._bitmask

    def _apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        grammars = [seqs[i].grammar for i in rows]
        self.bitmask(logits.shape[1]).apply(logits, rows, [g.matcher for g in grammars],
                                            [g.opening_token for g in grammars])

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        random_rows = [i for i, seq in enumerate(seqs) if not seq.sampling_params.is_greedy]
        if not random_rows:
            return _argmax(logits)
        all_random = len(random_rows) == len(seqs)
        chosen = seqs if all_random else [seqs[i] for i in random_rows]
        x = logits if all_random else logits[random_rows]
        temperature = torch.tensor([seq.sampling_params.temperature for seq in chosen], dtype=torch.float32)
        if any(_truncates(seq.sampling_params) for seq in chosen):
            # min_p, top_k and top_p read the tempered logits.
            x.div_(temperature.to(x.device)[:, None])
            apply_min_p(x, chosen)
            apply_top_k_top_p(x, chosen)
            scales = None
        else:
            scales = temperature.reciprocal_()
        random_sampled = _draw(x, self._uniforms(chosen), scales)
        if all_random:
            return random_sampled
        sampled = _argmax(logits)
        sampled[torch.tensor(random_rows, device=sampled.device)] = random_sampled
        return sampled

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One uniform in [0, 1) per row (float64), the draw the row's token is sampled at: from the
        row's own generator when it is seeded, so its tokens never depend on the batch."""
        seeded = [(i, seq) for i, seq in enumerate(seqs) if seq.sample_seed is not None]
        u = torch.rand(len(seqs), dtype=torch.float64, device=self.device) if len(seeded) < len(seqs) \
            else torch.empty(len(seqs), dtype=torch.float64, device=self.device)
        for i, seq in seeded:
            u[i] = torch.rand(1, dtype=torch.float64, device=self.device, generator=self._generator(seq))[0]
        return u

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.sample_seed & _SEED_MASK)
            self._generators[seq.seq_id] = generator
        return generator


def apply_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> None:
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


def apply_top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """vLLM's top_k then top_p (top_p over the top_k-renormalised probabilities).

    Rows with only top_k take a topk threshold; rows with top_p look at their top candidates
    first and fall back to vLLM's full sort only when those cannot decide. Which path a row
    takes depends only on that row, never on the batch.
    """
    vocab_size = logits.shape[1]
    params = [seq.sampling_params for seq in seqs]
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    top_k_rows = [i for i, p in enumerate(params) if p.top_p >= 1.0 and 0 < p.top_k < vocab_size]

    def top_k(rows: list[int]) -> torch.Tensor:
        k = [min(params[i].top_k or vocab_size, vocab_size) for i in rows]
        return torch.tensor(k, dtype=torch.long, device=logits.device)

    if top_p_rows:
        top_p = torch.tensor([params[i].top_p for i in top_p_rows], device=logits.device)
        _update_rows(logits, top_p_rows, lambda x: _top_k_top_p(x, top_k(top_p_rows), top_p))
    if top_k_rows:
        _update_rows(logits, top_k_rows, lambda x: _top_k_only(x, top_k(top_k_rows)))


def _top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep every token at least as large as the k-th largest (ties at the threshold all stay)."""
    top_values = logits.topk(int(k.max()), dim=-1).values
    threshold = top_values.gather(1, (k - 1)[:, None])
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                 candidates: tuple[int, ...] | None = None) -> torch.Tensor:
    """Same result as _top_k_top_p_sorted, from the top candidates[0] tokens of each row
    (default: TOP_P_CANDIDATES), the rows they leave undecided from the next tier's.

    In descending order a token survives top_p when 1 - (mass of the tokens above it) > 1 - p
    (vLLM's ascending cumsum, read from the top). The candidates decide a row when top_k cuts
    inside them (no tie at the k-th value runs past them), or, with top_k off, when the first
    token past them is dropped. Other rows (a flat distribution, k > candidates) go to the next
    tier, and past the last to a sort of the row.
    """
    vocab_size = logits.shape[1]
    candidates = TOP_P_CANDIDATES if candidates is None else candidates
    n = min(candidates[0], vocab_size)
    top_values, indices = logits.topk(n, dim=-1)
    k_on = (k < vocab_size)[:, None]
    kth = top_values.gather(1, (k.clamp(max=n) - 1)[:, None])
    values = top_values.masked_fill(k_on & (top_values < kth), float("-inf"))
    lse = torch.where(k_on, torch.logsumexp(values, dim=-1, keepdim=True),
                      torch.logsumexp(logits, dim=-1, keepdim=True))
    probs = (values - lse).exp_()
    cumulative = probs.cumsum(dim=-1)
    one_minus_p = (1 - p[:, None]).to(probs.dtype)
    drop = 1 - (cumulative - probs) <= one_minus_p
    drop[:, 0] = False
    values.masked_fill_(drop, float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter_(1, indices, values)
    if n < vocab_size:
        decided = torch.where(k_on, (k[:, None] <= n) & (top_values[:, -1:] < kth),
                              1 - cumulative[:, -1:] <= one_minus_p)[:, 0]
        if not bool(decided.all()):
            rows = torch.nonzero(~decided).flatten()
            rest = candidates[1:]
            out[rows] = (_top_k_top_p(logits[rows], k[rows], p[rows], rest) if rest
                         else _top_k_top_p_sorted(logits[rows], k[rows], p[rows]))
    return out


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


def _truncates(params) -> bool:
    return params.min_p > 0.0 or params.top_p < 1.0 or params.top_k > 0


def _edits_logits(seq: Sequence) -> bool:
    """Whether sampling this row changes its logits in place (else they are only read)."""
    p = seq.sampling_params
    return (bool(p.logit_bias) or has_penalties(seq) or min_tokens_active(seq)
            or (not p.is_greedy and _truncates(p)))


def _draw(logits: torch.Tensor, uniforms: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Each row's token from softmax(logits * scale) at its uniform, by inverse CDF: the native
    kernel on CPU (the exponential race it replaced drew a random number and took a log per
    vocabulary entry, a large share of a decode step; csrc/sample.c),
    pagedserve.kernels.reference.sample_rows elsewhere."""
    if native_sample.usable(logits):
        return native_sample.sample_rows(logits, uniforms.cpu(), scales)
    return reference.sample_rows(logits, uniforms.to(logits.device),
                                 None if scales is None else scales.to(logits.device))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of ties): the native kernel on CPU (several times faster than
    torch's, more so on bf16 logits), torch's elsewhere."""
    return native_argmax.argmax_rows(logits) if native_argmax.usable(logits) else logits.argmax(dim=-1)
