"""A reasoning model's text split into its thinking and its answer, whole or as it streams.

The engine holds a request's grammar back until the thinking ends, from the same facts
(`replicas/core/reasoning.py`); here the text is cut at the same place, so tool calls and JSON are
parsed from the answer alone, and the thinking never reaches `content` or a call's arguments.
"""
from __future__ import annotations

from pagedserve.replicas.core.reasoning import ReasoningFormat, reasoning_format

_MAY_OPEN, _THINKING, _ANSWER = range(3)


class ChatReasoning:
    """One chat request's reasoning facts: where its output starts (from its prompt), a splitter
    per choice, and how many of a choice's tokens were thinking."""

    def __init__(self, parser: str, prompt_text: str, tokenizer):
        self.format = fmt = reasoning_format(parser)
        self.at_start = fmt.thinking_at_start(prompt_text, fmt.start, fmt.end)
        self.start_id, self.end_id = tokenizer.convert_tokens_to_ids([fmt.start, fmt.end])

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.format, self.at_start)

    def num_tokens(self, token_ids: list[int]) -> int:
        """The choice's thinking tokens, its tags included: OpenAI's `reasoning_tokens`."""
        opened = self.at_start or (self.format.model_opens and token_ids[:1] == [self.start_id])
        if not opened:
            return 0
        return token_ids.index(self.end_id) + 1 if self.end_id in token_ids else len(token_ids)


class ReasoningSplitter:
    """One choice's text, fed in deltas, split into (reasoning, content) deltas. A tag cut across
    deltas is held back until it is whole, so no delta ever carries part of one."""

    __slots__ = ("format", "state", "held", "at_start", "thought")

    def __init__(self, fmt: ReasoningFormat, thinking_at_start: bool):
        self.format = fmt
        self.state = _THINKING if thinking_at_start else _MAY_OPEN if fmt.model_opens else _ANSWER
        self.held = ""
        self.at_start = True  # nothing emitted yet: a leading start tag is dropped
        self.thought = thinking_at_start  # the output had a thinking block

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        text, self.held = self.held + text, ""
        start, end = self.format.start, self.format.end
        while text:
            if self.state != _ANSWER and self.at_start:
                if text.startswith(start):
                    text = text[len(start):]
                    self.state, self.thought = _THINKING, True
                elif start.startswith(text):
                    self.held = text  # perhaps the start tag: wait for more
                    break
                elif self.state == _MAY_OPEN:
                    self.state = _ANSWER
                self.at_start = False
                continue
            if self.state == _ANSWER:
                content += text
                break
            i = text.find(end)
            if i >= 0:
                reasoning += text[:i]
                text = text[i + len(end):]
                self.state = _ANSWER
                continue
            keep = _partial_suffix(text, end)
            reasoning += text[:len(text) - keep]
            self.held = text[len(text) - keep:]
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the text: a partial tag is text after all."""
        held, self.held = self.held, ""
        return (held, "") if self.state == _THINKING else ("", held)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole text: (reasoning, content), reasoning None without a thinking block and content
        None where a thinking block left no answer, as vLLM returns them."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        if not self.thought:
            return None, content
        return reasoning, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
