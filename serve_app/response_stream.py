"""A streamed chat answer as the Responses API's typed events, in OpenAI's order.

`response.created` and `response.in_progress` open the stream; each output item (a block of
`answer_blocks`) then goes `response.output_item.added` → its deltas
(`response.reasoning_text.delta`, `response.output_text.delta` inside a content part,
`response.function_call_arguments.delta`) → its `.done` events → `response.output_item.done`;
`response.completed` carries the whole response last, its status "incomplete" where
max_output_tokens ran out (as vLLM sends it: the SDK's stream helper finishes only on
`response.completed`). Every event has a `sequence_number`; an item's id is made once, so its
`added` and `done` agree.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.serve_app.answer_blocks import (
    REASONING, TEXT, AnswerBlocks, BlockDelta, BlockEvent, BlockStart, BlockStop,
)
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.protocol import ChatCompletionStreamResponse
from pagedserve.serve_app.protocol.responses import (
    FunctionCallItem, OutputMessage, OutputText, ReasoningItem, ReasoningText, ResponseObject,
)
from pagedserve.serve_app.response_items import finish


class ResponseEvents:
    """Events (dicts) for one response: `events(chunks)` up to the last item's, then
    `completed()` (or `failed(error)`)."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self.blocks = AnswerBlocks()
        self.sequence_number = 0
        self.item: ReasoningItem | OutputMessage | FunctionCallItem | None = None

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _snapshot(self) -> dict:
        return self.response.model_dump(mode="json")

    async def events(self, chunks: AsyncIterator[ChatCompletionStreamResponse]
                     ) -> AsyncIterator[dict]:
        started = False
        async for chunk in chunks:
            if not started:
                started = True
                self.response.model = chunk.model
                yield self.event("response.created", response=self._snapshot())
                yield self.event("response.in_progress", response=self._snapshot())
            for block in self.blocks.feed(chunk):
                for event in self._render(block):
                    yield event
        blocks = self.blocks.close()
        if not any(isinstance(item, OutputMessage | FunctionCallItem) for item in self.response.output):
            blocks += [BlockStart(TEXT), BlockStop(TEXT)]  # an empty answer is still a message
        for block in blocks:
            for event in self._render(block):
                yield event
        finish(self.response, self.blocks.finish_reason, self.blocks.usage)

    def completed(self) -> dict:
        return self.event("response.completed", response=self._snapshot())

    def failed(self, error: OpenAIError) -> list[dict]:
        """OpenAI's `error` event, then the response as it stood, failed."""
        self.response.status = "failed"
        self.response.error = {"code": error.code or error.type, "message": error.message}
        return [self.event("error", code=error.code, message=error.message, param=error.param),
                self.event("response.failed", response=self._snapshot())]

    def _render(self, block: BlockEvent):
        if isinstance(block, BlockStart):
            yield from self._start(block)
            return
        item, index = self.item, len(self.response.output) - 1
        if isinstance(block, BlockDelta):
            if block.kind == REASONING:
                item.content[0].text += block.text
                yield self.event("response.reasoning_text.delta", item_id=item.id,
                                 output_index=index, content_index=0, delta=block.text)
            elif block.kind == TEXT:
                logprobs = ([p.model_dump() for p in block.logprobs.content]
                            if block.logprobs is not None and block.logprobs.content else [])
                item.content[0].text += block.text
                item.content[0].logprobs += logprobs
                yield self.event("response.output_text.delta", item_id=item.id, output_index=index,
                                 content_index=0, delta=block.text, logprobs=logprobs)
            else:
                item.arguments += block.text
                yield self.event("response.function_call_arguments.delta", item_id=item.id,
                                 output_index=index, delta=block.text)
            return
        if block.kind == REASONING:
            yield self.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                             content_index=0, text=item.content[0].text)
        elif block.kind == TEXT:
            part = item.content[0]
            yield self.event("response.output_text.done", item_id=item.id, output_index=index,
                             content_index=0, text=part.text, logprobs=part.logprobs)
            yield self.event("response.content_part.done", item_id=item.id, output_index=index,
                             content_index=0, part=part.model_dump(mode="json"))
        else:
            yield self.event("response.function_call_arguments.done", item_id=item.id,
                             output_index=index, name=item.name, arguments=item.arguments)
        item.status = "incomplete" if self.blocks.finish_reason == "length" else "completed"
        self.item = None
        yield self.event("response.output_item.done", output_index=index,
                         item=item.model_dump(mode="json"))

    def _start(self, block: BlockStart):
        if block.kind == REASONING:
            item = ReasoningItem(status="in_progress", content=[ReasoningText(text="")])
        elif block.kind == TEXT:
            item = OutputMessage(status="in_progress")
        else:
            item = FunctionCallItem(call_id=block.call_id, name=block.name, status="in_progress")
        self.item = item
        self.response.output.append(item)
        index = len(self.response.output) - 1
        yield self.event("response.output_item.added", output_index=index,
                         item=item.model_dump(mode="json"))
        if block.kind == TEXT:
            yield self.event("response.content_part.added", item_id=item.id, output_index=index,
                             content_index=0, part=OutputText(text="").model_dump(mode="json"))
            item.content.append(OutputText(text="", logprobs=[]))

