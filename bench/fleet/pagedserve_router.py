"""The router under test, driven as the Ray Serve shim drives it, and the oracle.

`PagedServeRouter` makes exactly the calls `serve_app.routing.router.PrefixAffinityRouter` makes
on `RouterState`: on each broadcast of the replica set (`update_replicas`) it observes every
replica's latest digest; per request (`choose_replicas`) it observes them all again, retains the
live set, and asks `choose`; then `routed` when a replica accepted it and `completed` when it
finished. Digests are the real `RoutingReporter`'s, delivered late by the fleet's stats delay.
"""
from __future__ import annotations

import random
from collections.abc import Mapping

from bench.fleet.replica import Request, SimReplica
from serve_app.routing.policy import RoutingSettings, choose_replica
from serve_app.routing.router_state import RouterState


class PagedServeRouter:
    name = "pagedserve"

    def __init__(self, clock, seed: int, settings: RoutingSettings | None = None):
        self.state = RouterState(settings or RoutingSettings(), rng=random.Random(seed), clock=clock)
        self.digests: dict[str, dict] = {}  # what RunningReplica.routing_stats holds now

    def update_replicas(self, digests: Mapping[str, dict]) -> None:
        self.digests.update(digests)
        for replica_id in list(self.digests):
            if replica_id not in digests:
                del self.digests[replica_id]
        self._observe(self.digests)

    def choose(self, request: Request, live: list[str]) -> list[str]:
        self._observe(live)
        self.state.retain(live)
        return self.state.choose(request.request_id, list(request.block_hashes), live).ranked

    def routed(self, request: Request, replica_id: str) -> None:
        self.state.routed(request.request_id, replica_id)

    def completed(self, request: Request) -> None:
        self.state.completed(request.request_id)

    def _observe(self, replica_ids) -> None:
        for replica_id in replica_ids:
            self.state.observe(replica_id, self.digests.get(replica_id))


class OracleRouter:
    """The same policy function fed the truth: each replica's cache and queue as they are now."""

    name = "oracle"

    def __init__(self, replicas: Mapping[str, SimReplica], seed: int,
                 settings: RoutingSettings | None = None):
        self.replicas = replicas
        self.settings = settings or RoutingSettings()
        self.rng = random.Random(seed)

    def update_replicas(self, digests: Mapping[str, dict]) -> None:
        pass

    def choose(self, request: Request, live: list[str]) -> list[str]:
        hashes = request.block_hashes
        limit = (request.num_prompt_tokens - 1) // self.replicas[live[0]].settings.block_size
        loads, matches = {}, {}
        for replica_id in live:
            replica = self.replicas[replica_id]
            loads[replica_id] = replica.num_requests
            cached = replica.block_manager.cached
            num = 0
            while num < limit and hashes[num] in cached:
                num += 1
            matches[replica_id] = num
        return choose_replica(hashes[:limit], loads, matches, self.settings, self.rng).ranked

    def routed(self, request: Request, replica_id: str) -> None:
        pass

    def completed(self, request: Request) -> None:
        pass
