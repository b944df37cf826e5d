"""RequestStream: one request on its way through an engine core, as the ingress's formatters read
it: sent (`prime`), its outputs (the pending deltas folded into one when the reader is behind),
stopped in its core when the client leaves or a stop string ends it (`cancel`); and
`merge_streams`, the deltas of several (a prompt list) as they arrive."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pagedserve.replicas.engine import protocol
from pagedserve.serve_app.output_queue import OutputQueue
from pagedserve.replicas.core.outputs import RequestOutput
from pagedserve.serve_app import errors
from pagedserve.serve_app.stream_pacer import StreamPacer
from pagedserve.serve_app.stream_text import StreamText

if TYPE_CHECKING:
    from pagedserve.serve_app.core_link import CoreLink
    from pagedserve.serve_app.engine_client import EngineClient


class Refused(Exception):
    """The core did not take the request (full or draining): try the next one."""


class LinkLost(Exception):
    """The request's core went away before its first output: send it again elsewhere."""


class RequestStream:
    """One request on its way through a core: `prime()` sends it and waits for its first output,
    so errors (a full queue, a bad request) surface before a response starts; iteration yields
    its outputs, the pending deltas folded into one when the consumer is behind."""

    def __init__(self, client: EngineClient, request: protocol.AddRequest,
                 text: StreamText | None = None, pacer: StreamPacer | None = None):
        self.client = client
        self.request = request
        self.request_id = request.request_id
        self.text = text
        self.pacer = pacer or StreamPacer(0)
        self.queue = OutputQueue()
        self.link: CoreLink | None = None
        self.first: RequestOutput | None = None
        self.first_delta_time: float | None = None
        self.first_choice: str | None = None
        self.sent_at = 0.0
        self.queued = False  # in the admission queue
        self.wake: asyncio.Future | None = None
        self.finished = False

    async def prime(self) -> None:
        client = self.client
        tried: set[str] = set()
        had_turn = False  # it reached the head of the queue: a refusal keeps it there
        try:
            while True:
                if client.waiting and not had_turn:  # those waiting go first
                    await client.admit(self)
                    had_turn = True
                self.link = client.place(self, tried)
                if self.link is None:
                    await client.admit(self, front=had_turn)
                    had_turn = True
                    tried.clear()
                    continue
                client.leave_queue(self)  # sent: the next in line may try too
                try:
                    self.first = await self.queue.get()
                    break
                except Refused:
                    client.router.refused(self.request_id, self.link.replica_id,
                                          self.request.block_hashes or [], self.sent_at)
                    tried.add(self.link.replica_id)
                except LinkLost:
                    client.router.completed(self.request_id)
                    tried.add(self.link.replica_id)
                self.link = None
                self.queue = OutputQueue()
        except BaseException:
            client.leave_queue(self)
            self.cancel()
            raise
        self.first_delta_time = time.monotonic()
        client.router.first_output(self.request_id)

    def lost(self) -> None:
        """Its core went away."""
        if self.first is None and self.first_delta_time is None:
            self.queue.put(LinkLost())
        else:
            self.queue.put(errors.unavailable("the engine replica serving this request went away",
                                              self.client.retry_after_s))

    def cancel(self) -> None:
        """Stop the request in its core (the client left, or the request failed)."""
        if self.finished:
            return
        self.finished = True
        if self.link is not None:
            self.link.abort(self.request_id)
            self.client.request_ended(self)

    def _done(self) -> None:
        self.finished = True
        if self.link is not None:
            self.link.requests.pop(self.request_id, None)
            self.client.request_ended(self)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        output, self.first = self.first, None
        pacer = self.pacer
        text = self.text
        pacer.num_streams += 1
        try:
            while True:
                sent = time.monotonic()
                if text is not None and text.fill(output):  # ended on a stop string here
                    self.link.abort(self.request_id)
                yield output
                pacer.sent()
                if output.finished:
                    self._done()
                    return
                try:
                    output = await self.queue.get()
                    wait = pacer.interval_s() - (time.monotonic() - sent)
                    if wait > 0 and not output.finished:
                        await asyncio.sleep(wait)
                        later = self.queue.get_nowait()
                        if later is not None:
                            output.add(later)
                except Exception:  # the request failed: nothing is left to cancel
                    self._done()
                    raise
        finally:  # a consumer that left early still has to cancel() the request
            pacer.num_streams -= 1


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, delta) as they arrive. One stream is iterated directly (the common case)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
            queue.put_nowait((i, end))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
