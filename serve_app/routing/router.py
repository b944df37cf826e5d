"""PrefixAffinityRouter: the Ray Serve `RequestRouter` on the ingress -> engine-replica handle.

A thin shim over `RouterState`: it reads the replicas' digests (`record_routing_stats`, via
`RunningReplica.routing_stats`) when Ray hands it the replica set (the only time they change), ranks
every live replica one per rank (Ray takes the first rank whose replica has room, so a full first
choice falls through to the next; the ranks past the first are made only if Ray asks for them),
and keeps the bookkeeping in step through Ray's routed/completed callbacks. Per request it does
nothing per replica in Python: Ray passes the same candidate list until the set changes.

The request's block hashes come from the handle call: a `block_hashes` keyword argument, or an
argument that has a `block_hashes` attribute or key. Without them a request is routed by load.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from replicas.deployment import ChannelRequest
from serve_app.routing import replica_events
from serve_app.routing.metrics import RoutingMetrics
from serve_app.routing.policy import Decision, RoutingSettings
from serve_app.routing.router_state import RouterState

BLOCK_HASHES_KEY = "block_hashes"


def pinned_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica an output channel's opening call must reach, if this is one."""
    args = pending_request.args if pending_request is not None else ()
    return args[0].replica_id if args and isinstance(args[0], ChannelRequest) else None


def request_block_hashes(args: Any, kwargs: Any) -> list[int]:
    """Find the prompt's block hashes among a handle call's arguments."""
    if kwargs and kwargs.get(BLOCK_HASHES_KEY):
        return list(kwargs[BLOCK_HASHES_KEY])
    for value in [*(args or ()), *((kwargs or {}).values())]:
        hashes = (value.get(BLOCK_HASHES_KEY) if isinstance(value, dict)
                  else getattr(value, BLOCK_HASHES_KEY, None))
        if hashes:
            return list(hashes)
    return []


class PrefixAffinityRouter(RequestRouter):
    """Longest cached prefix, guarded by load; cold prefixes to a consistent home; else p2c."""

    def initialize_state(self, **kwargs):
        self.settings = RoutingSettings(**kwargs)
        self.state = RouterState(self.settings)
        self.metrics = RoutingMetrics(self._deployment_id.app_name, self._deployment_id.name)
        self._observed: dict[str, Any] = {}  # replica -> the routing stats last applied
        self._candidates: list[RunningReplica] | None = None  # the list `_live` was made from
        self._live: dict[str, RunningReplica] = {}
        self._live_ids: tuple[str, ...] = ()  # its keys: the same tuple until the set changes
        # Every running replica, as Ray last named them: what the ingress's own sends rank (Ray
        # may name them before this runs).
        self._dispatch_ids: tuple[str, ...] = getattr(self, "_dispatch_ids", ())
        replica_events.router_ready(self._deployment_id.app_name, self._deployment_id.name, self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # Ray re-broadcasts the replica set each time a replica's routing stats change, requests or
        # not: reading every digest here keeps each replica's KV event stream gapless even while
        # no request comes to read it (a digest holds only its last few seconds of events).
        super().update_replicas(replicas)
        if hasattr(self, "state"):
            self._observe(replicas)
        seen = [(r.replica_id.unique_id, (r.routing_stats or {}).get("last_generation_time"))
                for r in replicas]
        replica_events.replicas_seen(self._deployment_id.app_name, self._deployment_id.name, seen)
        ids = tuple(replica_id for replica_id, _ in seen)
        if ids != getattr(self, "_dispatch_ids", None):  # one tuple until the set changes
            self._dispatch_ids = ids

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> Iterable[list[RunningReplica]]:
        if not hasattr(self, "state"):  # initialize_state is always called; be safe anyway
            self.initialize_state()
        if not candidate_replicas:
            return []
        live = self._live_replicas(candidate_replicas)
        pinned = pinned_replica(pending_request)
        if pinned is not None:  # an output channel: that replica or none (the opener times out)
            pending_request.routing_context.should_backoff = True
            return [[live[pinned]]] if pinned in live else []
        request_id = None
        block_hashes: list[int] = []
        if pending_request is not None:
            # Ray retries right away (no backoff) unless told otherwise; when every replica is
            # full, back off instead of spinning.
            pending_request.routing_context.should_backoff = True
            request_id = pending_request.metadata.internal_request_id
            block_hashes = request_block_hashes(pending_request.args, pending_request.kwargs)
        decision = self.state.choose(request_id, block_hashes, self._live_ids)
        return ([live[replica_id]] for replica_id in decision.ranking())  # Ray only iterates it

    def choose_for_dispatch(self, block_hashes: list[int]) -> Decision | None:
        """The ranking for a request the ingress sends itself (`serve_app/core_dispatch.py`),
        counted against no replica yet (`dispatched` does, for the one that takes it); None
        before Ray has named any replica."""
        live_ids = self._dispatch_ids or self._live_ids  # (what Ray's own calls ranked)
        if not live_ids:
            return None
        return self.state.choose(None, block_hashes, live_ids)

    def dispatched(self, request_id: str, replica_id: str, block_hashes: list[int],
                   decision: Decision) -> float:
        reason, at = self.state.dispatched(request_id, replica_id, block_hashes, decision)
        self.metrics.record_decision(reason)
        return at

    def _live_replicas(self, candidate_replicas: list[RunningReplica]) -> dict[str, RunningReplica]:
        """Ray hands the same list object until the replica set changes: map it once."""
        if candidate_replicas is not self._candidates or len(candidate_replicas) != len(self._live):
            self._candidates = candidate_replicas
            self._live = {r.replica_id.unique_id: r for r in candidate_replicas}
            self._live_ids = tuple(self._live)
            self._observe(candidate_replicas)
            self.state.retain(self._live)
        return self._live

    def _observe(self, replicas: list[RunningReplica]) -> None:
        """Apply the digests that changed since the last look (Ray replaces a replica's stats
        dict when new ones arrive, so identity says it)."""
        observed = self._observed
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            stats = replica.routing_stats
            if observed.get(replica_id) is stats:
                continue
            observed[replica_id] = stats
            if self.state.observe(replica_id, stats):
                self.metrics.record_load(replica_id, self.state.load(replica_id))
        if len(observed) > 2 * len(replicas) + 64:  # forget replicas long gone
            alive = {r.replica_id.unique_id for r in replicas}
            for replica_id in [r for r in observed if r not in alive]:
                del observed[replica_id]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        if pinned_replica(pending_request) is not None:  # a channel, not a routing decision
            return
        request_id = pending_request.metadata.internal_request_id
        replica_events.routed(request_id, replica_id.unique_id)
        reason = self.state.routed(request_id, replica_id.unique_id)
        self.metrics.record_decision(reason)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica_events.ended(internal_request_id)
        if hasattr(self, "state"):
            self.state.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        replica_events.replica_died(replica_id.unique_id)
