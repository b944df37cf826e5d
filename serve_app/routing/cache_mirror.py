"""One replica's prefix cache as a router mirrors it: the cached block hashes, kept exact by
applying the replica's KV-cache event stream (`pagedserve.replicas.core.kv_events`) in sequence order.

Each report carries the numbered events of the last few seconds; the mirror applies those past the
last one it applied. A mirror starts as a replica starts, empty before event 0, so a router that
hears a replica from its first seconds on is exact without any snapshot. A hole in the numbering
(a router that joined late, or missed reports for longer than the window, or a replica whose log
overflowed) makes the mirror inexact: it keeps what it has and goes on applying events (most of
it is still right, which routes better than nothing), but is out of sync until a snapshot, which
replaces it outright. Snapshots come on a replica's first report, after its log dropped events,
and every minute as a safety net.

A listener (the `PrefixIndex`) hears every hash that enters or leaves the mirror, so it can keep
its block hash -> replicas index from the same stream. Pure Python.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pagedserve.replicas.core.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, events_from, read_snapshot,
)


class MirrorListener(Protocol):
    def stored(self, block_hashes: Iterable[int]) -> None: ...
    def removed(self, block_hashes: Iterable[int]) -> None: ...


class CacheMirror:
    def __init__(self, listener: MirrorListener | None = None):
        self.listener = listener  # told of hashes that were not in the mirror / are gone from it
        self.block_hashes: set[int] = set()
        self.next_seq = 0  # the number of the next event to apply
        self.in_sync = True  # block_hashes is exactly the replica's cache as of event next_seq - 1
        self.num_holes = 0

    def apply(self, stream: Mapping[str, Any]) -> None:
        """Apply one report's stream (`kv_events.wire_stream`); reports must come in order."""
        snapshot = read_snapshot(stream)
        if snapshot is not None:
            held = set(snapshot.block_hashes)
            if self.listener is not None:
                self.listener.removed(self.block_hashes - held)
                self.listener.stored(held - self.block_hashes)
            self.block_hashes = held
            self.next_seq = snapshot.seq
            self.in_sync = True
        for seq, event in events_from(stream["events"], self.next_seq):
            if seq != self.next_seq:
                self._hole()
            self._apply_event(event)
            self.next_seq = seq + 1
        if self.next_seq < stream["seq"]:  # nothing of the missing events came along
            self._hole()
            self.next_seq = stream["seq"]

    def _hole(self) -> None:
        self.in_sync = False
        self.num_holes += 1

    def _apply_event(self, event: KVCacheEvent) -> None:
        held, listener = self.block_hashes, self.listener
        match event:
            case BlockStored(block_hashes=block_hashes):
                if listener is not None:
                    listener.stored([h for h in block_hashes if h not in held])
                held.update(block_hashes)
            case BlockRemoved(block_hashes=block_hashes):
                if listener is not None:
                    listener.removed([h for h in block_hashes if h in held])
                held.difference_update(block_hashes)
            case AllBlocksCleared():
                if listener is not None:
                    listener.removed(list(held))
                held.clear()
