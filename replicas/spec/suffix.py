"""Suffix decoding (vLLM's "suffix" method, after Snowflake's Arctic Inference): drafts from the
sequence's own prompt and from the outputs of recent requests, this one's included, so an agent
loop or a repeated task whose answers recur across requests is drafted from them even when they
are not in the prompt.

The context (the sequence's last max_depth tokens) is matched against each corpus: every place
its last two tokens occur is a candidate, and its match length is how far back the context and
the corpus agree. For each match length m (longest first), the candidates matching at least m
tokens are followed forward together: the next draft token is the one most of them continue
with, its probability the running product of those shares, and the draft stops below
min_token_prob, at m * max_spec_factor tokens (a short match earns a short draft), or where
match and draft would pass max_depth. Of the drafts from the prompt and from the outputs, the one
with the highest score (its tokens' probabilities summed) wins, a longer match on a tie: Arctic's
suffix-tree walk, over an index of token pairs instead of a tree.

Memory: each corpus keeps its tokens and, per token pair, where it occurs; outputs of at most
max_cached requests are kept, running ones included, the one that ended longest ago dropped
first.
"""
from __future__ import annotations

from collections import OrderedDict

# Candidates followed per lookup, the most recent first: bounds a lookup's time on a token pair
# that recurs a great deal.
MAX_CANDIDATES = 256


class Corpus:
    """A token sequence and, for each pair of consecutive tokens, the positions of its second."""

    __slots__ = ("tokens", "pairs")

    def __init__(self):
        self.tokens: list[int] = []
        self.pairs: dict[tuple[int, int], list[int]] = {}

    def extend(self, token_ids: list[int]) -> None:
        tokens, pairs = self.tokens, self.pairs
        for token in token_ids:
            if tokens:
                pairs.setdefault((tokens[-1], token), []).append(len(tokens))
            tokens.append(token)


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, max_depth: int, max_cached: int,
                 max_spec_factor: float, min_token_prob: float):
        self.k = num_speculative_tokens
        self.max_depth = max_depth
        self.max_cached = max_cached
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._prompts: dict[int, Corpus] = {}  # seq_id -> its prompt, while it runs
        self._outputs: OrderedDict[int, Corpus] = OrderedDict()  # seq_id -> its output so far
        self._running: set[int] = set()

    def release(self, seq_id: int, token_ids: list[int] = (), num_prompt_tokens: int = 0) -> None:
        """A sequence ended with these tokens: its prompt is dropped, its whole output stays
        among the cached ones."""
        output = self._outputs.get(seq_id)
        if output is None and len(token_ids) > num_prompt_tokens + 1:  # never drafted for
            output = self._outputs[seq_id] = Corpus()
        if output is not None:
            known = num_prompt_tokens + len(output.tokens)
            if token_ids and known < len(token_ids):
                output.extend(list(token_ids[known:]))
        if output is not None:
            self._outputs.move_to_end(seq_id)  # the cache drops the longest ended first
        self._prompts.pop(seq_id, None)
        self._running.discard(seq_id)
        self._evict()

    def observe(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int) -> Corpus:
        """Take in a running sequence's new output tokens (every step, drafts or not); its
        prompt's corpus."""
        prompt = self._prompts.get(seq_id)
        if prompt is None:
            prompt = self._prompts[seq_id] = Corpus()
            prompt.extend(token_ids[:num_prompt_tokens])
            self._outputs[seq_id] = Corpus()
            self._running.add(seq_id)
            self._evict()
        output = self._outputs[seq_id]
        known = num_prompt_tokens + len(output.tokens)
        if known < len(token_ids):
            output.extend(token_ids[known:])
        return prompt

    def propose(self, seq_id: int, token_ids: list[int], max_drafts: int,
                num_prompt_tokens: int = 0) -> list[int]:
        prompt = self.observe(seq_id, token_ids, num_prompt_tokens)
        max_drafts = min(self.k, max_drafts)
        context = token_ids[-self.max_depth:]
        if max_drafts <= 0 or len(context) < 2:
            return []
        local = self._best([prompt], context, max_drafts)
        shared = self._best(reversed(self._outputs.values()), context, max_drafts)
        return max(local, shared)[2]

    def _best(self, corpora, context: list[int], max_drafts: int) -> tuple[float, int, list[int]]:
        """(score, match length, draft) of the best draft from these corpora."""
        key = (context[-2], context[-1])
        candidates = []  # (match length, corpus tokens, position after the match)
        for corpus in corpora:
            for end in reversed(corpus.pairs.get(key, ())):
                tokens = corpus.tokens
                if end + 1 >= len(tokens):  # nothing follows it (the context's own end)
                    continue
                m = 2  # up to the context less one token, as Arctic's walk
                while m < len(context) - 1 and m <= end and tokens[end - m] == context[-1 - m]:
                    m += 1
                candidates.append((m, tokens, end + 1))
                if len(candidates) == MAX_CANDIDATES:
                    break
            if len(candidates) == MAX_CANDIDATES:
                break
        best = (0.0, 0, [])
        lengths = sorted({c[0] for c in candidates}, reverse=True)
        for index, longest in enumerate(lengths):
            # Every match length down to the next candidate's shares these candidates: the
            # one allowing the longest draft (a match of m tokens earns m * max_spec_factor,
            # and the two together reach max_depth at most) is their best, the longer on a tie.
            shortest = lengths[index + 1] + 1 if index + 1 < len(lengths) else 2
            if self._allowed(longest, max_drafts, cap=False) <= best[0]:
                break  # a draft's score is at most its length: shorter matches do no better
            m = max(range(longest, shortest - 1, -1), key=lambda n: self._allowed(n, max_drafts))
            limit = self._allowed(m, max_drafts)
            if limit <= 0:
                continue
            draft = self._follow([(t, i) for n, t, i in candidates if n >= longest], limit)
            if draft[0] > best[0]:
                best = (draft[0], m, draft[1])
        return best

    def _allowed(self, m: int, max_drafts: int, cap: bool = True) -> int:
        """The longest draft a match of m tokens may give."""
        earned = min(max_drafts, int(m * self.max_spec_factor + 1e-6))
        return min(earned, self.max_depth - m) if cap else earned

    def _follow(self, alive: list[tuple[list[int], int]], limit: int) -> tuple[float, list[int]]:
        """The candidates' most common continuation: (score, tokens)."""
        prob, score, draft = 1.0, 0.0, []
        while len(draft) < limit and alive:
            counts: dict[int, int] = {}
            for tokens, i in alive:
                if i < len(tokens):
                    counts[tokens[i]] = counts.get(tokens[i], 0) + 1
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])
            prob *= count / len(alive)
            if prob < self.min_token_prob:
                break
            draft.append(token)
            score += prob
            alive = [(tokens, i + 1) for tokens, i in alive if i < len(tokens) and tokens[i] == token]
        return score, draft

    def _evict(self) -> None:
        """Keep the outputs of at most max_cached requests (never a running one's): those that
        ended longest ago go first."""
        excess = len(self._outputs) - max(self.max_cached, len(self._running))
        for seq_id in list(self._outputs):
            if excess <= 0:
                break
            if seq_id not in self._running:
                del self._outputs[seq_id]
                excess -= 1
