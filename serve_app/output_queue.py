"""OutputQueue: one request's outputs on their way to one consumer.

A consumer that keeps up gets each output as it is made; one that fell behind gets everything
pending as a single output (deltas folded together with `RequestOutput.add`: the engine protocol
carries deltas), so per-token work downstream shrinks exactly when it is the bottleneck and never
delays a token for an idle consumer. Pure asyncio: the ingress's `RequestStream` reads it.
"""
from __future__ import annotations

import asyncio

from pagedserve.replicas.core.outputs import RequestOutput


class OutputQueue:
    def __init__(self):
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False  # a finished output or an error has been put

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        pending = self._pending
        if isinstance(item, BaseException) or pending is None:
            self._pending = item
        else:
            pending.add(item)
        self.finished = isinstance(item, BaseException) or item.finished
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        """Everything pending as one output, or None; raises a pending error."""
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item

    async def get(self) -> RequestOutput:
        while self._pending is None:
            await self._ready.wait()
        return self.get_nowait()

    async def __aiter__(self):
        while True:
            item = await self.get()
            yield item
            if item.finished:
                return
