"""A streamed chat answer as content blocks: the shape the Responses and Messages doors stream.

The thinking, the text and each tool call are blocks that start, grow by deltas and stop, in
the order the model wrote them; a block of another kind (or a new call) closes the open one.
Both doors render these same events, so they agree on where each block begins and ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.serve_app.protocol import ChatCompletionStreamResponse, ChoiceLogprobs, Usage

REASONING, TEXT, CALL = "reasoning", "text", "call"


@dataclass(slots=True)
class BlockStart:
    kind: str
    call_id: str | None = None  # a call's id and function name
    name: str | None = None


@dataclass(slots=True)
class BlockDelta:
    kind: str
    text: str  # thinking, answer text, or a call's arguments (JSON text)
    logprobs: ChoiceLogprobs | None = None  # the answer text's, where asked


@dataclass(slots=True)
class BlockStop:
    kind: str


BlockEvent = BlockStart | BlockDelta | BlockStop


class AnswerBlocks:
    """Block events from a chat stream's chunks (its first choice: these doors have no `n`), and
    the stream's finish reason and usage as they arrive."""

    def __init__(self):
        self.open: str | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.usage: Usage | None = None

    def feed(self, chunk: ChatCompletionStreamResponse) -> list[BlockEvent]:
        self.usage = chunk.usage or self.usage
        events: list[BlockEvent] = []
        for choice in chunk.choices[:1]:
            delta = choice.delta
            if delta.reasoning_content:
                events += self._open(REASONING)
                events.append(BlockDelta(REASONING, delta.reasoning_content))
            if delta.content:
                events += self._open(TEXT)
                events.append(BlockDelta(TEXT, delta.content, choice.logprobs))
            for call in delta.tool_calls or []:
                if call.id is not None:  # a call starts: its id and name come first
                    events += self.close()
                    self.open = CALL
                    events.append(BlockStart(CALL, call.id, call.function.name or ""))
                if call.function.arguments and self.open == CALL:
                    events.append(BlockDelta(CALL, call.function.arguments))
            if choice.finish_reason is not None:
                self.finish_reason, self.stop_reason = choice.finish_reason, choice.stop_reason
        return events

    def close(self) -> list[BlockEvent]:
        """The open block's stop (at the end of the answer, or before another block)."""
        if self.open is None:
            return []
        kind, self.open = self.open, None
        return [BlockStop(kind)]

    def _open(self, kind: str) -> list[BlockEvent]:
        if self.open == kind:
            return []
        events = self.close()
        self.open = kind
        return [*events, BlockStart(kind)]
