"""One sequence's place in its grammar. No torch: the control plane may hold it (opaquely)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from pagedserve.replicas.core.reasoning import ThinkingTokens
    from pagedserve.replicas.core.request import Request

logger = logging.getLogger(__name__)


class GrammarMatcher:
    """Mirrors a sequence's output tokens in an llguidance matcher.

    `advance(token_ids, num_prompt_tokens)` makes the matcher match exactly the output tokens: it consumes the
    new ones and rolls back any it had consumed that the sequence no longer has, so the state
    stays right whatever the engine did to the sequence in between (a recompute after
    preemption keeps the tokens; anything that drops some is undone here).

    Under a reasoning model the grammar constrains the answer only: while the sequence thinks
    (`is_active` false) its tokens are free, and the grammar starts after the thinking's end
    token. Where the model may open its thinking itself, the first token may also be that start
    token (`opening_token`), besides what the grammar allows.
    """

    __slots__ = ("matcher", "num_consumed", "offset", "num_scanned", "thinking_at_start",
                 "start_id", "end_id")

    def __init__(self, matcher: llguidance.LLMatcher, thinking_at_start: bool = False,
                 start_id: int | None = None, end_id: int | None = None):
        self.matcher = matcher
        self.num_consumed = 0
        self.thinking_at_start = thinking_at_start
        self.start_id = start_id  # a first token that opens the thinking; None: it cannot
        self.end_id = end_id
        self.offset = None if thinking_at_start else 0  # output index the grammar starts at
        self.num_scanned = 0  # output tokens searched for the end of the thinking

    @property
    def is_active(self) -> bool:
        """The grammar constrains the next token (the sequence is not thinking)."""
        return self.offset is not None

    @property
    def opening_token(self) -> int | None:
        """A token allowed at this position besides the grammar's: the thinking's start, as the
        first output token."""
        return self.start_id if self.offset == 0 and self.num_consumed == 0 else None

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """token_ids: the sequence's, prompt first. False when a token broke the grammar (the
        matcher is then in its error state)."""
        num_tokens = len(token_ids) - num_prompt_tokens
        if self.offset is not None and num_tokens < self.offset or num_tokens < self.num_scanned:
            self._restart()
        if self.opening_token is not None and num_tokens and token_ids[num_prompt_tokens] == self.start_id:
            self.offset = None  # the model opened its thinking: the grammar waits for the end
            self.num_scanned = 1
        if self.offset is None:
            for i in range(num_prompt_tokens + self.num_scanned, len(token_ids)):
                if token_ids[i] == self.end_id:
                    self.offset = i + 1 - num_prompt_tokens
                    break
            self.num_scanned = num_tokens
            if self.offset is None:
                return True
        num_output = num_tokens - self.offset
        start = num_prompt_tokens + self.offset
        if num_output < self.num_consumed:
            self.matcher.rollback(self.num_consumed - num_output)
            self.num_consumed = num_output
        if num_output > self.num_consumed:
            ok = self.matcher.consume_tokens(token_ids[start + self.num_consumed:])
            self.num_consumed = num_output
            if not ok:
                logger.warning("a sampled token broke its grammar: %s", self.matcher.get_error())
                return False
        return True

    def _restart(self) -> None:
        """The sequence lost tokens it was matched on: back to the state before its output."""
        if self.num_consumed:
            self.matcher.rollback(self.num_consumed)
        self.num_consumed = 0
        self.offset = None if self.thinking_at_start else 0
        self.num_scanned = 0

    def num_allowed(self, drafts: list[int]) -> int:
        """How many of the drafts, in order, the sequence could take: while thinking, those before
        its end (the token after the end would need the grammar); else those the grammar allows."""
        if not self.is_active:
            return drafts.index(self.end_id) if self.end_id in drafts else len(drafts)
        return self.matcher.validate_tokens(drafts)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (or broke): the sequence ends."""
        return self.is_active and self.matcher.is_stopped()


def is_constrained(seq) -> bool:
    """Whether the grammar masks this sequence's next token."""
    return seq.grammar is not None and seq.grammar.is_active


def attach_grammar(request: Request, thinking: ThinkingTokens | None = None) -> None:
    """Give each of the request's sequences its own matcher (under a reasoning model, gated by
    its thinking); raises the ParamError of a grammar that failed to compile."""
    start = request.grammar.result()
    gate = {}
    if thinking is not None:
        at_start = thinking.thinking_at_start(request.prompt_token_ids)
        gate = dict(thinking_at_start=at_start, end_id=thinking.end_id,
                    start_id=thinking.start_id if thinking.format.model_opens and not at_start else None)
    for seq in request.seqs:
        seq.grammar = GrammarMatcher(start.deep_copy(), **gate)
