"""What a replica publishes for the router and the autoscaler: its prefix cache and its queue.

The routing digest carries the block manager's KV-cache event stream (`pagedserve.replicas.core.kv_events`): the
stored/removed/cleared events of the last few seconds, numbered, and a full snapshot of the cached
block hashes (free-but-still-cached blocks included: they are still hits) only when a reader may
need one to resync. Events rather than a snapshot every second because the cost then follows the
churn (a few hundred blocks a second) instead of the cache size (tens to hundreds of thousands of
blocks), and every digest goes to every ingress; and since
the snapshot is rare it need not be capped, so the router's mirror is exact at any cache size.

Pure Python: no torch, no ray. The engine core sends `RoutingReporter.report` to its ingresses;
the replica's `record_autoscaling_stats` is `autoscaling_stats` of the core's stats.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from pagedserve.replicas.core.kv_events import KVEventPublisher

DIGEST_VERSION = 2  # 1 was a snapshot of up to 65,536 hashes in every digest
# Above this KV-cache usage, running sequences start to count as queued: a nearly full cache admits
# nothing new and starts preempting, so more replicas are needed before anything waits.
KV_PRESSURE_START = 0.9
# The keys of `autoscaling_stats`, which the autoscaling policy reads.
QUEUE_DEPTH_METRIC = "queue_depth"
LOAD_METRIC = "load"
KV_WORKING_SET_METRIC = "kv_working_set"


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


class StepReport(NamedTuple):
    """What each engine step's outputs tell the routers of the ingresses they go to (on an
    engine core's connections): the replica's queue as of the step's end, milliseconds old
    where a digest is up to a second old (`pagedserve.serve_app.routing.load`)."""
    time: float  # the wall clock (as a digest's "time" is) when the counts below were closed
    num_requests: int  # waiting + running: QueueDepth.num_requests
    num_arrived: int  # requests ever received, from every router
    queued_prefill_blocks: int  # Scheduler.queued_prefill_tokens, in blocks


def step_report(engine, now: float | None = None) -> StepReport:
    """`engine` (an LLMEngine, or anything with its `scheduler`, `num_waiting`, `num_arrived` and
    `block_size`) as of `now` (None: the wall clock's)."""
    scheduler = engine.scheduler
    return StepReport(time.time() if now is None else now,
                      engine.num_waiting + scheduler.num_running, engine.num_arrived,
                      scheduler.queued_prefill_tokens() // engine.block_size)


class RoutingReporter:
    """The routing digest of one engine core (anything with `stats()` and `.engine`; an engine
    without a `block_manager` has no prefix cache, and publishes its queue depth only). It holds
    the stream's state, so a core keeps one for its lifetime."""

    def __init__(self, core, *, wall_clock: Callable[[], float] = time.time, **publisher):
        self.core = core
        self.wall_clock = wall_clock
        block_manager = getattr(getattr(core, "engine", None), "block_manager", None)
        self.block_size = getattr(block_manager, "block_size", None)
        self.publisher = (KVEventPublisher(block_manager, **publisher) if block_manager is not None
                          else None)

    def report(self, *, force_snapshot: bool = False) -> dict[str, Any]:
        """The digest: plain types only (it travels in the engine protocol)."""
        stats = self.core.stats()
        depth = QueueDepth.from_stats(stats)
        return {
            "version": DIGEST_VERSION,
            "time": self.wall_clock(),  # wall clock: routers compare it with theirs
            "block_size": self.block_size,
            "kv_events": (self.publisher.report(force_snapshot=force_snapshot)
                          if self.publisher else None),
            "num_waiting": depth.num_waiting,
            "num_running": depth.num_running,
            "kv_cache_usage": depth.kv_cache_usage,
            # Requests ever received, from every router: a router's share of them is its
            # ingress's share of the traffic (`pagedserve.serve_app.routing.load`).
            "num_arrived": stats.get("num_arrived"),
            "prefix_cache_hit_rate": float(stats.get("prefix_cache_hit_rate", 0.0)),
            # Wall clock of the engine's last sampled token (None: never): the ingress's readiness.
            "last_generation_time": stats.get("last_generation_time"),
            # The LoRA adapters it holds in memory (their ids): the router prefers these replicas.
            "lora_resident_ids": stats.get("lora_resident_ids", []),
        }


def autoscaling_inputs(block_manager, step_load, now: float) -> dict[str, float]:
    """The engine's stats `autoscaling_stats` reads beside the queue: its prefix working set in
    replicas' worth of KV cache (`pagedserve.replicas.core.working_set`), and its compute beyond a step's fixed
    part (`pagedserve.replicas.core.step_load`), both as of `now`."""
    return {"kv_working_set": block_manager.working_set.measure(now) / block_manager.num_blocks,
            "compute_utilization": step_load.utilization(now)}


def autoscaling_stats(stats: dict[str, Any], kv_pressure_start: float = KV_PRESSURE_START
                      ) -> dict[str, float]:
    """For `record_autoscaling_stats()`: Ray Serve window-averages each key per replica.

    `load` is what a replica carries that is not queued, as a fraction of what it can carry:
    sequence slots (running / max_num_seqs), KV blocks (long prompts fill the cache long before
    max_num_seqs run) or compute (`pagedserve.replicas.core.step_load`), whichever binds first. A fleet whose
    replicas are full but whose queues are empty must not scale down on its zero queue depth,
    and one nearing full must scale up before a queue forms. `kv_working_set`
    (`pagedserve.replicas.core.working_set`, in replicas' worth of KV cache) is the cache its prompts' reuse
    needs: a fleet must not scale down below what holds it. Requests that wait in an ingress's
    admission queue with this replica first in their ranking count as queued here."""
    depth = QueueDepth.from_stats(stats)
    out = {QUEUE_DEPTH_METRIC: depth.autoscaling_depth(kv_pressure_start)
           + float(stats.get("num_queued_at_ingress", 0))}
    max_num_seqs = stats.get("max_num_seqs")
    if max_num_seqs:
        out[LOAD_METRIC] = min(1.0, max(depth.num_running / max_num_seqs, depth.kv_cache_usage,
                                        float(stats.get("compute_utilization", 0.0))))
    if "kv_working_set" in stats:
        out[KV_WORKING_SET_METRIC] = float(stats["kv_working_set"])
    return out
