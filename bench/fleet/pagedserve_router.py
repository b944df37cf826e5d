"""The router under test, driven as the ingress drives it, and the oracle.

`PagedServeRouter` makes exactly the calls `pagedserve.serve_app.engine_client.EngineClient` makes on
`RouterState`: it observes each digest that arrives (`update_replicas`); when the fleet's routable
set changes it retains it (the fleet offers a retry only the replicas with room, which must not
make the router forget the others); per request it asks `choose` for a ranking (counted against no
replica yet), then `dispatched` for the replica that took it (the ingress sends down the ranking,
a full core refusing, until one takes it), `first_output` at its first token and `completed` when
it finished. Digests are the real `RoutingReporter`'s, delivered late by the fleet's stats delay.
Each step's outputs reach the ingress with the replica's step report (`observe_step`), as they do
on an engine core's connection, before the ingress handles them one by one.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from bench.fleet.replica import Request, SimReplica
from pagedserve.serve_app.routing.policy import RoutingSettings, rank_replicas
from pagedserve.serve_app.routing.prefix_index import PrefixMatch
from pagedserve.serve_app.routing.rendezvous import ReplicaSet
from pagedserve.serve_app.routing.router_state import RouterState


class PagedServeRouter:
    name = "pagedserve"

    def __init__(self, clock, seed: int, settings: RoutingSettings | None = None,
                 routable: Callable[[], Sequence[str]] | None = None):
        self.state = RouterState(settings or RoutingSettings(), rng=random.Random(seed), clock=clock)
        self.digests: dict[str, dict] = {}  # what RunningReplica.routing_stats holds now
        self.routable = routable  # the fleet's live replicas, now; None: the candidates
        self._retained: Sequence[str] | None = None
        self._decision = None  # the last request's, for `routed`

    def update_replicas(self, digests: Mapping[str, dict]) -> None:
        for replica_id, digest in digests.items():
            if self.digests.get(replica_id) is not digest:
                self.state.observe(replica_id, digest)
        self.digests = dict(digests)

    def choose(self, request: Request, live: Sequence[str]):
        routable = self.routable() if self.routable is not None else live
        if routable is not self._retained:  # a new tuple: the set changed
            self._retained = routable
            self.state.retain(routable)
        self._decision = self.state.choose(None, list(request.block_hashes), live)
        return self._decision.ranking()

    def routed(self, request: Request, replica_id: str) -> None:
        self.state.dispatched(request.request_id, replica_id, list(request.block_hashes),
                              self._decision)

    def step_outputs(self, replica: SimReplica, sequences: Sequence) -> None:
        # Of the requests with an output, those with their first: the others' prompts were
        # already counted off, and a step of a busy replica has hundreds.
        first, finished = [], []
        for seq in sequences:
            request = seq.request
            if request.first_token_s is None:
                first.append(request.request_id)
            if seq.status.is_finished:
                finished.append(request.request_id)
        self.state.observe_step(replica.replica_id, first, finished, replica.step_report())

    def first_token(self, request: Request) -> None:
        self.state.first_output(request.request_id)

    def completed(self, request: Request) -> None:
        self.state.completed(request.request_id)


class OracleRouter:
    """The same policy function fed the truth: each replica's cache and queue as they are now,
    and the blocks it was missing of each prompt not yet prefilled there."""

    name = "oracle"

    def __init__(self, replicas: Mapping[str, SimReplica], seed: int,
                 settings: RoutingSettings | None = None):
        self.replicas = replicas
        self.settings = settings or RoutingSettings()
        self.rng = random.Random(seed)
        self.queued_prefill: dict[str, int] = {}
        self._matches: dict[str, int] = {}  # the last decision's, for `routed`
        self._queued: dict[str, int] = {}  # request id -> its blocks in queued_prefill

    def update_replicas(self, digests: Mapping[str, dict]) -> None:
        pass

    def choose(self, request: Request, live: list[str]) -> list[str]:
        hashes = request.block_hashes
        limit = self._prompt_blocks(request, live[0])
        loads, matches = {}, {}
        for replica_id in live:
            replica = self.replicas[replica_id]
            loads[replica_id] = replica.num_requests
            cached = replica.block_manager.cached
            num = 0
            while num < limit and hashes[num] in cached:
                num += 1
            matches[replica_id] = num
        self._matches = matches
        common = min(matches.values())
        deeper = {r: m for r, m in matches.items() if m > common}
        return rank_replicas(hashes[:limit], ReplicaSet(loads, loads), PrefixMatch(common, deeper),
                             self.settings, self.rng, self.queued_prefill).ranking()

    def routed(self, request: Request, replica_id: str) -> None:
        blocks = self._queued[request.request_id] = (self._prompt_blocks(request, replica_id)
                                                     - self._matches.get(replica_id, 0))
        self.queued_prefill[replica_id] = self.queued_prefill.get(replica_id, 0) + blocks

    def first_token(self, request: Request) -> None:
        self.queued_prefill[request.replica_id] -= self._queued.pop(request.request_id)

    def completed(self, request: Request) -> None:
        pass

    def _prompt_blocks(self, request: Request, replica_id: str) -> int:
        """The prompt's full blocks a cache hit can cover (its last token is always computed)."""
        return (request.num_prompt_tokens - 1) // self.replicas[replica_id].settings.block_size
