"""One sequence's place in its grammar. No torch: the control plane may hold it (opaquely)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from pagedserve.replicas.core.request import Request

logger = logging.getLogger(__name__)


class GrammarMatcher:
    """Mirrors a sequence's output tokens in an llguidance matcher.

    `advance(token_ids, num_prompt_tokens)` makes the matcher match exactly the output tokens: it consumes the
    new ones and rolls back any it had consumed that the sequence no longer has, so the state
    stays right whatever the engine did to the sequence in between (a recompute after
    preemption keeps the tokens; anything that drops some is undone here).
    """

    __slots__ = ("matcher", "num_consumed")

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.num_consumed = 0

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """token_ids: the sequence's, prompt first. False when a token broke the grammar (the
        matcher is then in its error state)."""
        num_output = len(token_ids) - num_prompt_tokens
        if num_output < self.num_consumed:
            self.matcher.rollback(self.num_consumed - num_output)
            self.num_consumed = num_output
        if num_output > self.num_consumed:
            ok = self.matcher.consume_tokens(token_ids[num_prompt_tokens + self.num_consumed:])
            self.num_consumed = num_output
            if not ok:
                logger.warning("a sampled token broke its grammar: %s", self.matcher.get_error())
                return False
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (or broke): the sequence ends."""
        return self.matcher.is_stopped()


def attach_grammar(request: Request) -> None:
    """Give each of the request's sequences its own matcher; raises the ParamError of a grammar
    that failed to compile."""
    start = request.grammar.result()
    for seq in request.seqs:
        seq.grammar = GrammarMatcher(start.deep_copy())
