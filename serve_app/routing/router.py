"""PrefixAffinityRouter: the Ray Serve `RequestRouter` on the ingress -> engine-replica handle.

A thin shim over `RouterState`: it reads the replicas' digests (`record_routing_stats`, via
`RunningReplica.routing_stats`) whenever Ray hands it the replica set, ranks every live replica one
per rank (Ray takes the first rank whose replica has room, so a full first choice falls through to
the next), and keeps the bookkeeping in step through Ray's routed/completed callbacks.

The request's block hashes come from the handle call: a `block_hashes` keyword argument, or an
argument that has a `block_hashes` attribute or key. Without them a request is routed by load.
"""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from replicas.deployment import ChannelRequest
from serve_app.routing import replica_events
from serve_app.routing.metrics import RoutingMetrics
from serve_app.routing.policy import RoutingSettings
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

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # Ray re-broadcasts the replica set each time a replica's routing stats change, requests or
        # not: reading every digest here keeps each replica's KV event stream gapless even while
        # no request comes to read it (a digest holds only its last few seconds of events).
        super().update_replicas(replicas)
        if hasattr(self, "state"):
            self._observe(replicas)
        replica_events.replicas_seen(
            self._deployment_id.app_name, self._deployment_id.name,
            [(r.replica_id.unique_id, (r.routing_stats or {}).get("last_generation_time"))
             for r in replicas])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not hasattr(self, "state"):  # initialize_state is always called; be safe anyway
            self.initialize_state()
        if not candidate_replicas:
            return []
        live = {r.replica_id.unique_id: r for r in candidate_replicas}
        pinned = pinned_replica(pending_request)
        if pinned is not None:  # an output channel: that replica or none (the opener times out)
            pending_request.routing_context.should_backoff = True
            return [[live[pinned]]] if pinned in live else []
        self._observe(candidate_replicas)
        self.state.retain(live)
        request_id = None
        block_hashes: list[int] = []
        if pending_request is not None:
            # Ray retries right away (no backoff) unless told otherwise; when every replica is
            # full, back off instead of spinning.
            pending_request.routing_context.should_backoff = True
            request_id = pending_request.metadata.internal_request_id
            block_hashes = request_block_hashes(pending_request.args, pending_request.kwargs)
        decision = self.state.choose(request_id, block_hashes, live)
        return [[live[replica_id]] for replica_id in decision.ranked]

    def _observe(self, replicas: list[RunningReplica]) -> None:
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            if self.state.observe(replica_id, replica.routing_stats):
                self.metrics.record_load(replica_id, self.state.load(replica_id))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        if pinned_replica(pending_request) is not None:  # a channel, not a routing decision
            return
        request_id = pending_request.metadata.internal_request_id
        replica_events.routed(request_id, replica_id.unique_id)
        reason = self.state.routed(request_id, replica_id.unique_id)
        self.metrics.record_decision(reason)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica_events.completed(internal_request_id)
        if hasattr(self, "state"):
            self.state.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        replica_events.replica_died(replica_id.unique_id)
