"""A replica's KV-cache events: what its prefix cache stored and dropped, as one numbered stream.

The three kinds vLLM publishes (`vllm/distributed/kv_events.py`): `BlockStored` (a run of
consecutive blocks of one hash chain, named by the parent of the first), `BlockRemoved`,
`AllBlocksCleared`. The block manager appends them to a `KVEventLog`, which numbers them 0, 1, 2...
and keeps the newest `capacity` of the last `retain_s` seconds; a reader that falls further behind
finds a hole and must resync from a `KVSnapshot`: the cached hashes plus the sequence number they
are consistent with.

`KVEventPublisher` is the replica's end of the stream, for Ray Serve's routing stats (which
travel as plain types: on the wire an event is a tuple `(seq, kind, *fields)`); the router's end
is `pagedserve.serve_app.routing.cache_mirror`. Pure Python: no torch, no ray.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

DEFAULT_LOG_CAPACITY = 1 << 16  # events; many times a report window's worth at a busy replica
# Events of the last few seconds go in every report (Ray polls about once a second), so a reader
# that misses a report or two, or a poll the controller timed out on, still sees a gapless stream.
EVENT_WINDOW_S = 3.0
SNAPSHOT_PERIOD_S = 60.0  # the safety net: even a reader that found a hole is exact again by then
# The log forgets events older than this, many report windows: a reader further behind resyncs
# from a snapshot anyway, and holding up to the capacity at a modest rate (a few hundred events a
# second) kept megabytes per replica for minutes, which a soak read as a leak.
LOG_RETAIN_S = 10 * EVENT_WINDOW_S

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]  # consecutive blocks of one chain
    parent_block_hash: int | None  # the block before the first; None at the root


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVSnapshot:
    seq: int  # replaying the events numbered seq onwards over block_hashes gives the cache
    block_hashes: list[int]


class KVEventLog:
    """Numbered and bounded, in count and in age (retain_s). The engine thread appends while
    Ray's stats call reads: a lock."""

    def __init__(self, capacity: int = DEFAULT_LOG_CAPACITY, retain_s: float = LOG_RETAIN_S,
                 clock: Callable[[], float] = time.monotonic):
        self._events: deque[KVCacheEvent] = deque(maxlen=capacity)  # a full deque drops the oldest
        self._times: deque[float] = deque(maxlen=capacity)  # when each was appended
        self._lock = threading.Lock()
        self.next_seq = 0  # the number the next event gets
        self.retain_s = retain_s
        self._clock = clock

    def append(self, event: KVCacheEvent) -> None:
        now = self._clock()
        with self._lock:
            events, times = self._events, self._times
            while times and times[0] < now - self.retain_s:
                times.popleft()
                events.popleft()
            events.append(event)
            times.append(now)
            self.next_seq += 1

    def since(self, seq: int) -> list[KVCacheEvent] | None:
        """The events numbered seq onwards, oldest first; None if some of them were dropped."""
        with self._lock:
            num = self.next_seq - seq
            if num < 0 or num > len(self._events):
                return None
            newest_first = list(itertools.islice(reversed(self._events), num))
        newest_first.reverse()
        return newest_first


class _CacheSource(Protocol):
    kv_events: KVEventLog
    cached: dict[int, int]  # block hash -> block id


def take_snapshot(source: _CacheSource) -> KVSnapshot:
    """Lock-free against the engine thread. The block manager changes `cached` before it logs the
    event saying so, and we read the log's head before copying, so every change the copy misses is
    numbered seq or later; a change it did catch but numbered seq or later is replayed over it
    harmlessly, since a hash's last event alone decides whether it is cached."""
    seq = source.kv_events.next_seq
    for _ in range(8):
        try:
            return KVSnapshot(seq, list(source.cached))  # one C-level copy
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    raise RuntimeError("the prefix cache kept changing while it was copied")


# -- the wire -----------------------------------------------------------------------------------
def encode_event(seq: int, event: KVCacheEvent) -> tuple:
    if isinstance(event, BlockStored):
        return (seq, STORED, event.block_hashes, event.parent_block_hash)
    if isinstance(event, BlockRemoved):
        return (seq, REMOVED, event.block_hashes)
    return (seq, CLEARED)


def decode_event(wire: tuple) -> KVCacheEvent:
    kind = wire[1]
    if kind == STORED:
        return BlockStored(list(wire[2]), wire[3])
    if kind == REMOVED:
        return BlockRemoved(list(wire[2]))
    if kind == CLEARED:
        return AllBlocksCleared()
    raise ValueError(f"unknown KV-cache event kind {kind!r}")


def events_from(wire_events: Iterable[tuple], seq: int) -> Iterator[tuple[int, KVCacheEvent]]:
    """(seq, event) for each wire event numbered seq or later."""
    for wire in wire_events:
        if wire[0] >= seq:
            yield wire[0], decode_event(wire)


def wire_stream(head: int, events: list[tuple], snapshot: KVSnapshot | None) -> dict[str, Any]:
    """A report's stream: `events` are the encoded events numbered up to head - 1 (contiguous);
    `snapshot` is there when a reader may need to resync."""
    return {"seq": head, "events": events,
            "snapshot": None if snapshot is None else {"seq": snapshot.seq,
                                                       "block_hashes": snapshot.block_hashes}}


def read_snapshot(stream: Mapping[str, Any]) -> KVSnapshot | None:
    snapshot = stream.get("snapshot")
    return None if snapshot is None else KVSnapshot(snapshot["seq"], snapshot["block_hashes"])


class KVEventPublisher:
    """The replica's end of the stream. Each report carries every event of the last `window_s`
    seconds, so whoever else calls, and whichever reports the controller drops, a reader that sees
    a report at least that often never finds a hole. A snapshot rides along when a reader may need
    one: on the first report, when the log has dropped events the window needed, and every
    `snapshot_period_s`."""

    def __init__(self, source: _CacheSource, *, window_s: float = EVENT_WINDOW_S,
                 snapshot_period_s: float = SNAPSHOT_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic):
        self.source = source
        self.window_s = window_s
        self.snapshot_period_s = snapshot_period_s
        self._clock = clock
        self._marks: deque[tuple[float, int]] = deque()  # (time, head) of earlier reports
        self._last_snapshot_at: float | None = None
        self._lock = threading.Lock()  # Ray may run two stats calls at once in its thread pool

    def report(self, *, force_snapshot: bool = False) -> dict[str, Any]:
        """The stream for one report; `force_snapshot` (tests, debugging) adds a snapshot without
        putting off the next scheduled one."""
        with self._lock:
            now = self._clock()
            due = (self._last_snapshot_at is None
                   or now - self._last_snapshot_at >= self.snapshot_period_s)
            snapshot = take_snapshot(self.source) if due or force_snapshot else None
            start = self._window_start(now)
            if start is None:
                start = snapshot.seq if snapshot else self.source.kv_events.next_seq
            events = self.source.kv_events.since(start)
            if events is None:  # the window reaches past what the log kept: readers must resync
                due = True
                snapshot = snapshot or take_snapshot(self.source)
                start = snapshot.seq
                events = self.source.kv_events.since(start) or []
            if due:
                self._last_snapshot_at = now
            head = start + len(events)
            self._marks.append((now, head))
        return wire_stream(head, [encode_event(start + i, e) for i, e in enumerate(events)],
                           snapshot)

    def _window_start(self, now: float) -> int | None:
        """The head of the newest earlier report at least window_s old (else of the oldest)."""
        horizon = now - self.window_s
        while len(self._marks) > 1 and self._marks[1][0] <= horizon:
            self._marks.popleft()
        return self._marks[0][1] if self._marks else None
