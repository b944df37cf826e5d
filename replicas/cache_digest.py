"""What a replica publishes for the router and the autoscaler: its cached prefix and its queue.

The routing digest is a full snapshot of the block manager's cached block hashes (free-but-still-
cached blocks included: they are still hits) plus the queue depth. A snapshot rather than a stream
of stored/evicted events because at our sizes it is small (a replica caches at most a few thousand
to tens of thousands of blocks: 8 bytes a hash, sent about once a second) and it is exact and
self-healing: nothing to lose, reorder or replay when a report is dropped or a router restarts.
Past `max_hashes` the most recently stored blocks are kept.

Pure Python: no torch, no ray. The deployment shim calls `routing_stats` / `autoscaling_stats`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

DIGEST_VERSION = 1
MAX_DIGEST_HASHES = 1 << 16
# Above this KV-cache usage, running sequences start to count as queued: a nearly full cache admits
# nothing new and starts preempting, so more replicas are needed before anything waits.
KV_PRESSURE_START = 0.9


class _BlockManagerLike(Protocol):
    block_size: int
    cached: dict[int, int]


@dataclass(slots=True, frozen=True)
class QueueDepth:
    num_waiting: int
    num_running: int
    kv_cache_usage: float

    @property
    def num_requests(self) -> int:
        """The routing load: everything the replica holds, waiting or running."""
        return self.num_waiting + self.num_running

    def autoscaling_depth(self, kv_pressure_start: float = KV_PRESSURE_START) -> float:
        """Waiting sequences, plus running ones in proportion to KV pressure past kv_pressure_start."""
        pressure = 0.0
        if kv_pressure_start < 1.0:
            pressure = max(0.0, self.kv_cache_usage - kv_pressure_start) / (1.0 - kv_pressure_start)
        return self.num_waiting + min(pressure, 1.0) * self.num_running

    @classmethod
    def from_stats(cls, stats: dict[str, Any]) -> "QueueDepth":
        return cls(int(stats.get("num_waiting", 0)), int(stats.get("num_running", 0)),
                   float(stats.get("kv_cache_usage", 0.0)))


def cached_block_hashes(block_manager: _BlockManagerLike, max_hashes: int = MAX_DIGEST_HASHES
                        ) -> list[int]:
    """A snapshot of the cached hashes, newest last. The engine steps in another thread, so copy
    the dict in one C-level call and retry if it changed size under us."""
    for _ in range(8):
        try:
            hashes = list(block_manager.cached)
            break
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    else:
        hashes = []
    return hashes[-max_hashes:] if len(hashes) > max_hashes else hashes


def build_digest(block_manager: _BlockManagerLike | None, stats: dict[str, Any], *,
                 now: float | None = None, max_hashes: int = MAX_DIGEST_HASHES) -> dict[str, Any]:
    """The routing-stats dict: plain types only (it travels through Ray Serve's controller).
    Without a block manager (an engine with no prefix cache) it carries the queue depth only."""
    depth = QueueDepth.from_stats(stats)
    return {
        "version": DIGEST_VERSION,
        "time": time.time() if now is None else now,  # wall clock: routers compare it with theirs
        "block_size": getattr(block_manager, "block_size", None),
        "block_hashes": cached_block_hashes(block_manager, max_hashes) if block_manager else [],
        "num_waiting": depth.num_waiting,
        "num_running": depth.num_running,
        "kv_cache_usage": depth.kv_cache_usage,
        "prefix_cache_hit_rate": float(stats.get("prefix_cache_hit_rate", 0.0)),
    }


def routing_stats(async_engine) -> dict[str, Any]:
    """For `record_routing_stats()`: the digest of an AsyncEngine; any engine with `stats()` works
    (one without `.engine.block_manager` publishes no hashes)."""
    block_manager = getattr(getattr(async_engine, "engine", None), "block_manager", None)
    return build_digest(block_manager, async_engine.stats())


def autoscaling_stats(async_engine, kv_pressure_start: float = KV_PRESSURE_START) -> dict[str, float]:
    """For `record_autoscaling_stats()`: Ray Serve window-averages each key per replica."""
    depth = QueueDepth.from_stats(async_engine.stats())
    return {"queue_depth": depth.autoscaling_depth(kv_pressure_start)}
