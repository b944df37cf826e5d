"""OutputChannel: many requests' outputs to one ingress replica, batched per engine step.

vLLM's engine core sends its API server one message per step holding every request's outputs;
this is that idea over Ray Serve. An ingress replica opens one long-lived streaming call per
engine replica (`EngineReplica.open_channel`); a request it sends names the channel, and its
outputs then travel in the channel's batches instead of its own stream: one Ray message per step
per ingress rather than one per request per token. What a request's own call still carries is
its routing, its `max_ongoing_requests` slot, its errors and its cancellation.

A channel with no request for `idle_timeout_s` ends itself, so a draining replica can finish
(Ray Serve waits for every ongoing call) and the ingress reopens it on demand.

Where the replica's engine steps in a process of its own, the ingress connects to that process
instead (`replicas/core_channels.py`), and this Ray form serves the other engines.
"""
from __future__ import annotations

import asyncio

from replicas.outputs import RequestOutput


class ChannelClosed(RuntimeError):
    pass


class OutputChannel:
    def __init__(self, idle_timeout_s: float):
        self.idle_timeout_s = idle_timeout_s
        self._pending: dict[str, RequestOutput] = {}
        self._requests: set[str] = set()
        self._ready = asyncio.Event()
        self.closed = False

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def attach(self, request_id: str) -> None:
        if self.closed:
            raise ChannelClosed("the output channel is closed")
        self._requests.add(request_id)

    def detach(self, request_id: str) -> None:
        self._requests.discard(request_id)
        if not self._requests:
            self._ready.set()  # start the idle clock

    def put(self, output: RequestOutput) -> None:
        pending = self._pending.get(output.request_id)
        if pending is None:
            self._pending[output.request_id] = output
        else:
            pending.add(output)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def batches(self):
        """Every pending output as one list, as soon as the previous list has gone."""
        while not self.closed:
            if not self._pending:
                self._ready.clear()
                try:
                    timeout = None if self._requests else self.idle_timeout_s
                    await asyncio.wait_for(self._ready.wait(), timeout)
                except asyncio.TimeoutError:
                    if not self._requests and not self._pending:
                        self.closed = True
                continue
            batch, self._pending = list(self._pending.values()), {}
            yield batch
