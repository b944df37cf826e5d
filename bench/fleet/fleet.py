"""The simulated deployment: replicas, the ingress's handle (Ray's routing loop, its queue and its
limits), the routing-stats broadcast, the autoscaler, and what gets measured.

Ray's handle semantics: the router ranks replicas; the request goes to the first ranked replica
below `max_ongoing_requests`; if none has room it waits in the handle's queue (rejected, a 503,
beyond `max_queued_requests`) and is routed again when a replica frees a slot. A retry offers the
router only the replicas with room, as Ray's repeated backed-off retries end up finding them.
"""
from __future__ import annotations

import gc
import time
from array import array
from collections import deque
from dataclasses import dataclass, field

from bench.fleet.autoscaler import Autoscaler, AutoscalerSettings
from bench.fleet.baselines import (ApproxPrefixRouter, PowerOfTwoRouter, RandomRouter,
                                   RoundRobinRouter)
from bench.fleet.clock import EventQueue
from bench.fleet.cost_model import CostModel
from bench.fleet.ingresses import Ingresses
from bench.fleet.pagedserve_router import OracleRouter, PagedServeRouter
from bench.fleet.replica import ReplicaSettings, Request, SimReplica
from bench.fleet.workloads import Workload
from pagedserve.serve_app.config import DEFAULTS as SERVE_DEFAULTS
from pagedserve.serve_app.routing.policy import RoutingSettings

ROUTERS = ("pagedserve", "p2c", "approx", "random", "roundrobin", "oracle")


@dataclass
class FleetSettings:
    num_replicas: int = 8  # the start; the autoscaler moves it when given
    replica: ReplicaSettings = field(default_factory=ReplicaSettings)
    stats_period_s: float = 1.0  # request_routing_stats_period_s
    stats_delay_s: float = 0.2  # replica -> controller -> router broadcast
    max_ongoing_requests: int | None = None  # None: the replica's max_num_seqs, as the app sets it
    max_queued_requests: int = SERVE_DEFAULTS["max_queued_requests"]
    sample_period_s: float = 1.0
    # Ingress replicas, each with a router of its own (`bench.fleet.ingresses`); the oracle,
    # which sees every cache, is one whatever this is.
    num_ingresses: int = 1
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    autoscaler: AutoscalerSettings | None = None


@dataclass
class Outcome:
    """Per request that got a first token (or was still waiting at the end: `censored`)."""
    stage: array = field(default_factory=lambda: array("i"))
    ttft_s: array = field(default_factory=lambda: array("d"))
    prompt_tokens: array = field(default_factory=lambda: array("q"))
    cached_tokens: array = field(default_factory=lambda: array("q"))
    censored: array = field(default_factory=lambda: array("b"))


class Fleet:
    def __init__(self, router_name: str, workload: Workload, cost_model: CostModel,
                 settings: FleetSettings, seed: int):
        self.settings = settings
        self.workload = workload
        self.cost_model = cost_model
        self.queue = EventQueue()
        self.replicas: dict[str, SimReplica] = {}
        # Routable replicas, in start order: a new tuple each time the set changes, as Ray hands
        # its router a new candidate list (which the router maps only then).
        self.live: tuple[str, ...] = ()
        self.starting: set[str] = set()
        self.draining: set[str] = set()
        self.ongoing: dict[str, int] = {}
        self.max_ongoing = settings.max_ongoing_requests or settings.replica.max_num_seqs
        self.handle_queue: deque[Request] = deque()
        self.waiting: dict[str, Request] = {}  # routed, no first token yet
        self.router = self._make_router(router_name, seed)
        self.autoscaler = Autoscaler(settings.autoscaler) if settings.autoscaler else None
        self.target = settings.num_replicas
        self._next_replica = 0
        self.outcome = Outcome()
        self.decision_s = array("d")
        self.num_arrivals = [0] * len(workload.stage_rates())
        self.num_rejected = [0] * len(workload.stage_rates())
        self.replica_seconds = 0.0
        self.removed_output_tokens = 0  # of replicas stopped before the end
        self._accounted_at = 0.0
        self.series: dict[str, list[float]] = {"t": [], "replicas": [], "handle_queue": [],
                                               "replica_queue": [], "kv_usage": []}
        for _ in range(settings.num_replicas):
            self._start_replica(ready=True)

    def _make_router(self, name: str, seed: int):
        num = self.settings.num_ingresses
        if num <= 1 or name == "oracle":
            return self._make_one_router(name, seed)
        return Ingresses([self._make_one_router(name, seed + i) for i in range(num)], seed)

    def _make_one_router(self, name: str, seed: int):
        if name == "pagedserve":
            return PagedServeRouter(self.queue, seed, self.settings.routing,
                                    routable=lambda: self.live)
        if name == "oracle":
            return OracleRouter(self.replicas, seed, self.settings.routing)
        if name == "approx":
            return ApproxPrefixRouter(seed, self.settings.replica.num_blocks,
                                      self.settings.replica.block_size)
        simple = {"p2c": PowerOfTwoRouter, "random": RandomRouter, "roundrobin": RoundRobinRouter}
        if name not in simple:
            raise ValueError(f"unknown router {name!r}: use one of {ROUTERS}")
        return simple[name](seed)

    # -- replicas coming and going ----------------------------------------------------------------
    def _start_replica(self, ready: bool) -> None:
        replica_id = f"replica-{self._next_replica:05d}"
        self._next_replica += 1
        self._account()
        self.replicas[replica_id] = SimReplica(replica_id, self.settings.replica, self.cost_model,
                                               self.queue, self._first_token, self._finished,
                                               getattr(self.router, "step_outputs", None))
        self.ongoing[replica_id] = 0
        if ready:
            self.live = (*self.live, replica_id)
        else:
            self.starting.add(replica_id)
            self.queue.after(self.settings.autoscaler.startup_s, lambda: self._ready(replica_id))

    def _ready(self, replica_id: str) -> None:
        if replica_id in self.starting:
            self.starting.discard(replica_id)
            self.live = (*self.live, replica_id)
            self._drain_handle_queue()

    def _stop_one(self) -> None:
        """Ray stops starting replicas first, then running ones; ours: the least busy."""
        self._account()
        if self.starting:
            replica_id = max(self.starting)
            self.starting.discard(replica_id)
            del self.replicas[replica_id]
            return
        replica_id = min(self.live, key=lambda r: self.ongoing[r])
        self.live = tuple(r for r in self.live if r != replica_id)
        self.draining.add(replica_id)
        self._maybe_remove(replica_id)

    def _maybe_remove(self, replica_id: str) -> None:
        if replica_id in self.draining and self.ongoing[replica_id] == 0:
            self._account()
            self.draining.discard(replica_id)
            self.removed_output_tokens += self.replicas.pop(replica_id).num_output_tokens

    def _account(self) -> None:
        now = self.queue.now
        self.replica_seconds += len(self.replicas) * (now - self._accounted_at)
        self._accounted_at = now

    # -- requests -------------------------------------------------------------------------------
    def _arrive(self, request: Request) -> None:
        # Ray counts a handle's queue before it routes: a request that finds it full is refused
        # without a routing decision; one that finds it empty is routed, and waits if no replica
        # has room.
        self.num_arrivals[request.stage] += 1
        if not self.handle_queue and self._route(request, self.live):
            return
        if len(self.handle_queue) >= self.settings.max_queued_requests:
            request.rejected = True
            self.num_rejected[request.stage] += 1
            return
        self.handle_queue.append(request)

    def _route(self, request: Request, candidates: list[str]) -> bool:
        if not candidates:
            return False
        # CPU time (other processes on these cores do not count) of the choice and of as much
        # of its ranking as the handle reads (a router may rank lazily).
        began = time.thread_time()
        for replica_id in self.router.choose(request, candidates):
            if self.ongoing[replica_id] < self.max_ongoing:
                self.decision_s.append(time.thread_time() - began)
                self.ongoing[replica_id] += 1
                self.router.routed(request, replica_id)
                self.waiting[request.request_id] = request
                self.replicas[replica_id].add(request)
                return True
        self.decision_s.append(time.thread_time() - began)
        return False

    def _drain_handle_queue(self) -> None:
        while self.handle_queue:
            with_room = [r for r in self.live if self.ongoing[r] < self.max_ongoing]
            if not with_room or not self._route(self.handle_queue[0], with_room):
                return
            self.handle_queue.popleft()

    def _first_token(self, request: Request) -> None:
        self.waiting.pop(request.request_id, None)
        self.router.first_token(request)
        self._record(request, request.first_token_s - request.arrival_s, censored=False)

    def _finished(self, request: Request) -> None:
        replica_id = request.replica_id
        self.ongoing[replica_id] -= 1
        self.router.completed(request)
        self._maybe_remove(replica_id)
        self._drain_handle_queue()

    def _record(self, request: Request, ttft_s: float, censored: bool) -> None:
        o = self.outcome
        o.stage.append(request.stage)
        o.ttft_s.append(ttft_s)
        o.prompt_tokens.append(request.num_prompt_tokens)
        o.cached_tokens.append(request.num_cached_tokens)
        o.censored.append(censored)

    # -- periodic work --------------------------------------------------------------------------
    def _broadcast_stats(self) -> None:
        digests = {r: self.replicas[r].record_routing_stats() for r in self.live}
        self.queue.after(self.settings.stats_delay_s, lambda: self._deliver(digests))

    def _deliver(self, digests: dict[str, dict]) -> None:
        live = set(self.live)
        self.router.update_replicas({r: d for r, d in digests.items() if r in live})

    def _push_autoscaling_stats(self) -> None:
        for replica_id in self.live:
            self.autoscaler.push(replica_id, self.replicas[replica_id].record_autoscaling_stats(),
                                 self.queue.now)

    def _autoscale(self) -> None:
        target = self.autoscaler.decide(self.queue.now, list(self.live), self.target,
                                        len(self.handle_queue))
        self.target = target
        while len(self.live) + len(self.starting) < target:
            self._start_replica(ready=False)
        while len(self.live) + len(self.starting) > target and len(self.live) > 1:
            self._stop_one()

    def _sample(self) -> None:
        s = self.series
        s["t"].append(self.queue.now)
        s["replicas"].append(len(self.replicas))
        s["handle_queue"].append(len(self.handle_queue))
        live = [self.replicas[r] for r in self.live]
        s["replica_queue"].append(sum(r.scheduler.num_waiting for r in live) / max(1, len(live)))
        s["kv_usage"].append(sum(r.block_manager.usage for r in live) / max(1, len(live)))

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> "Fleet":
        # No full collections while it runs: what a run makes mostly lives on (cached blocks,
        # requests in flight), and each full collection walked all of it again to find almost
        # nothing (at 1,000 replicas, 13 in an 8-s run, a quarter of its time). The young
        # collections still free the cycles that die young. A fleet is such a cycle itself (its
        # replicas call back into it): an earlier run's is freed first, not kept beside this one.
        gc.collect()
        thresholds = gc.get_threshold()
        gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)

    def _run(self) -> "Fleet":
        duration = self.workload.settings.duration_s
        q = self.queue
        arrivals = self.workload.requests()

        def next_arrival(request: Request | None) -> None:
            if request is not None:
                self._arrive(request)
            following = next(arrivals, None)
            if following is not None:
                q.at(following.arrival_s, lambda: next_arrival(following))

        next_arrival(None)
        q.every(self.settings.stats_period_s, self._broadcast_stats, until=duration)
        q.every(self.settings.sample_period_s, self._sample, until=duration)
        if self.autoscaler is not None:
            a = self.settings.autoscaler
            q.every(a.metrics_interval_s, self._push_autoscaling_stats, until=duration)
            q.every(a.control_interval_s, self._autoscale, start=a.control_interval_s,
                    until=duration)
        q.run(duration)
        self._account()
        for request in [*self.waiting.values(), *self.handle_queue]:  # still no first token
            self._record(request, duration - request.arrival_s, censored=True)
        return self
