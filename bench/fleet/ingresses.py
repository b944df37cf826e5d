"""Several ingress replicas, each with its own router, in front of one fleet.

A fleet serving tens of thousands of requests a second has many ingress replicas (a decision at a
thousand replicas costs tens of microseconds of one process's CPU), and Ray Serve gives each its
own handle, so its own router: each sees every replica's digest but only the requests it routed
itself, and the step reports of the replicas its requests run on. Its optimistic prefix inserts,
its sends since the last report and its prompts queued for prefill are its own; the others' show
only once a report does. Ray's proxies spread requests over the ingress replicas with no regard
for their prompts, so here each request goes to one drawn at random, and that router hears of
its routing, outputs, first token and end.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from bench.fleet.replica import Request


class Ingresses:
    """The router interface the fleet drives (`update_replicas`, `choose`, `routed`,
    `step_outputs`, `first_token`, `completed`), over one router per ingress replica."""

    def __init__(self, routers: Sequence, seed: int):
        self.routers = list(routers)
        self.name = self.routers[0].name
        self.rng = random.Random(seed)
        self._of: dict[str, object] = {}  # request id -> the router of its ingress

    def update_replicas(self, digests: Mapping[str, dict]) -> None:
        for router in self.routers:
            router.update_replicas(digests)

    def choose(self, request: Request, live: Sequence[str]):
        # A request queued at the handle is routed again by the ingress that took it.
        router = self._of.get(request.request_id)
        if router is None:
            router = self._of[request.request_id] = self.rng.choice(self.routers)
        return router.choose(request, live)

    def routed(self, request: Request, replica_id: str) -> None:
        self._of[request.request_id].routed(request, replica_id)

    def step_outputs(self, replica, sequences: Sequence) -> None:
        """A step's outputs leave for the ingresses of their requests, one frame each."""
        of = self._of
        by_router: dict[object, list] = {}
        for seq in sequences:
            router = of[seq.request.request_id]
            mine = by_router.get(router)
            if mine is None:
                by_router[router] = [seq]
            else:
                mine.append(seq)
        for router, mine in by_router.items():
            step_outputs = getattr(router, "step_outputs", None)
            if step_outputs is not None:
                step_outputs(replica, mine)

    def first_token(self, request: Request) -> None:
        self._of[request.request_id].first_token(request)

    def completed(self, request: Request) -> None:
        self._of.pop(request.request_id).completed(request)
