"""ResponseStore: stored responses (`store: true`), shared by every ingress replica.

A Ray Serve deployment of one small replica, as the core directory is: any ingress replica can
answer `GET /v1/responses/{id}` or continue a `previous_response_id` that another one made. Each
entry is the response and the conversation it ends, as one JSON blob made by the ingress. The
store is bounded by entries and by bytes (least recently used dropped first) and entries expire
after a time to live. It is memory only: a restart of the store's replica (or of the
application) loses every stored response, and a later `previous_response_id` naming one gets 404.
"""
from __future__ import annotations

import time
from collections import OrderedDict

DEFAULTS = dict(max_entries=10_000, max_bytes=256 << 20, ttl_s=24 * 3600.0)


class ResponseStore:
    """The store's methods are coroutines, so Ray Serve runs them one at a time on the replica's
    event loop (its plain methods may run in threads at once)."""

    def __init__(self, max_entries: int = DEFAULTS["max_entries"],
                 max_bytes: int = DEFAULTS["max_bytes"], ttl_s: float = DEFAULTS["ttl_s"],
                 clock=time.monotonic):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # id -> (blob, expiry)
        self.num_bytes = 0

    async def put(self, response_id: str, blob: bytes) -> bool:
        """False when nothing is kept (the blob alone is over max_bytes, or no entries are)."""
        self._drop(response_id)
        if len(blob) > self.max_bytes:
            return False
        self.entries[response_id] = (blob, self.clock() + self.ttl_s)
        self.num_bytes += len(blob)
        now = self.clock()
        while self.entries and (len(self.entries) > self.max_entries
                                or self.num_bytes > self.max_bytes
                                or next(iter(self.entries.values()))[1] <= now):
            _, (dropped, _) = self.entries.popitem(last=False)
            self.num_bytes -= len(dropped)
        return response_id in self.entries

    async def get(self, response_id: str) -> bytes | None:
        entry = self.entries.get(response_id)
        if entry is None:
            return None
        blob, expiry = entry
        if self.clock() >= expiry:
            self._drop(response_id)
            return None
        self.entries.move_to_end(response_id)
        return blob

    async def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= len(entry[0])
        return True

    async def stats(self) -> dict:
        return {"num_entries": len(self.entries), "num_bytes": self.num_bytes}
