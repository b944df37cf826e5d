"""The router's Prometheus metrics (through Ray's metrics agent), named once here.

Each replica exports its own prefix-cache hit rate (`pagedserve_prefix_cache_hit_rate{replica}`,
see `replicas/deployment/engine_replica.py`); the router adds why it sent each request where it did, and the load
it saw per replica.
"""
from __future__ import annotations

ROUTING_DECISIONS = "pagedserve_routing_decisions"
REPLICA_ROUTER_LOAD = "pagedserve_router_replica_load"


class RoutingMetrics:
    def __init__(self, application: str, deployment: str):
        from ray.util.metrics import Counter, Gauge

        default_tags = {"application": application, "deployment": deployment}
        self.decisions = Counter(
            ROUTING_DECISIONS,
            description="Requests routed to an engine replica, by reason: affinity (longest cached "
                        "prefix), load-override, cold-home (consistent hash of a cold prefix), "
                        "fallback (power of two choices).",
            tag_keys=("application", "deployment", "reason"))
        self.decisions.set_default_tags(default_tags)
        self.load = Gauge(
            REPLICA_ROUTER_LOAD,
            description="A replica's load as the router sees it: its reported waiting + running "
                        "requests, less those the router saw finish since, plus those it sent since.",
            tag_keys=("application", "deployment", "replica"))
        self.load.set_default_tags(default_tags)

    def record_decision(self, reason: str) -> None:
        self.decisions.inc(tags={"reason": reason})

    def record_load(self, replica_id: str, load: float) -> None:
        self.load.set(load, tags={"replica": replica_id})
