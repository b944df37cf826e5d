"""CoreDirectory: where the ingress replicas learn which engine cores there are and how to reach them.

A Ray Serve deployment of one small replica. Each engine replica publishes its core's address once
it is ready and again every PUBLISH_PERIOD_S (so a restarted directory fills up again at once,
and a replica that was killed without withdrawing drops out after ENTRY_TTL_S); it withdraws it
when it starts to drain. Each ingress replica long-polls `watch` and keeps a connection to every
core listed.

It also lists the LoRA adapters the application serves (name -> id and path), so that every
ingress replica resolves a name alike and an adapter's id (its identity in the cores' prefix
caches) is given once. Ids start from the clock, so a restarted directory never gives an old
id to other weights; adapters loaded at run time are lost with it (those of the
`lora_modules` setting are registered again by every ingress replica). Ray Serve stays the control plane (it starts, scales, replaces and drains the
replicas); the directory only tells the ingresses where the cores it started listen.
"""
from __future__ import annotations

import asyncio
import time

PUBLISH_PERIOD_S = 2.0
ENTRY_TTL_S = 3 * PUBLISH_PERIOD_S + 1.0
WATCH_TIMEOUT_S = 10.0
# A directory that has just started (Ray Serve replaced it) lists only the replicas that have
# published since: it answers once every live replica has had its turn.
WARMUP_S = PUBLISH_PERIOD_S + 1.0


class CoreDirectory:
    """Its methods are coroutines, so Ray Serve runs them one at a time on the replica's event
    loop, where `watch` waits (its plain methods may run in threads at once)."""

    def __init__(self, clock=time.monotonic, warmup_s: float = WARMUP_S):
        self.clock = clock
        self.ready_at = clock() + warmup_s
        self.entries: dict[str, tuple[list, float]] = {}  # replica id -> (address, published at)
        self.adapters: dict[str, list] = {}  # LoRA adapter name -> [name, id, path]
        self._next_adapter_id = time.time_ns() // 1000  # never an id of an earlier directory
        self.version = 0
        self._changed = asyncio.Event()

    async def publish(self, replica_id: str, address: list) -> None:
        """address: [host, port, token] of the replica's core."""
        old = self.entries.get(replica_id)
        self.entries[replica_id] = (list(address), self.clock())
        if old is None or old[0] != list(address):
            self._bump()
        self._expire()

    async def withdraw(self, replica_id: str) -> None:
        if self.entries.pop(replica_id, None) is not None:
            self._bump()

    async def register_adapter(self, name: str, path: str) -> tuple[list | None, bool]:
        """([name, id, path] of the adapter, whether this call listed it): under a new id unless
        it is listed with this path; (None, False) where another adapter has this name."""
        listed = self.adapters.get(name)
        if listed is not None:
            return (listed if listed[2] == path else None), False
        self._next_adapter_id += 1
        self.adapters[name] = [name, self._next_adapter_id, path]
        self._bump()
        return self.adapters[name], True

    async def remove_adapter(self, name: str) -> list | None:
        listed = self.adapters.pop(name, None)
        if listed is not None:
            self._bump()
        return listed

    async def watch(self, version: int, timeout_s: float = WATCH_TIMEOUT_S
                    ) -> tuple[int, dict[str, list], dict[str, list]]:
        """The listing once it differs from `version` (or after timeout_s): (version, entries,
        adapters)."""
        await asyncio.sleep(max(0.0, self.ready_at - self.clock()))
        deadline = self.clock() + timeout_s
        while version == self.version and self.clock() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(PUBLISH_PERIOD_S,
                                                                 deadline - self.clock()))
            except asyncio.TimeoutError:
                self._expire()
        return (self.version, {replica_id: entry[0] for replica_id, entry in self.entries.items()},
                dict(self.adapters))

    def _expire(self) -> None:
        horizon = self.clock() - ENTRY_TTL_S
        stale = [r for r, (_, seen) in self.entries.items() if seen < horizon]
        for replica_id in stale:
            del self.entries[replica_id]
        if stale:
            self._bump()

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
