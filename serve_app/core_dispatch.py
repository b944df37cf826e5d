"""Requests sent straight to an engine core, on this ingress's output channel to it.

Once the ingress has an output channel to an engine replica's core (`OutputChannels`, opened the
first time a request's Ray call met that replica), a request routed to that replica needs no Ray
call: the ingress asks the same `PrefixAffinityRouter` (its `RouterState`, in this process) for
its ranking, writes the request on the channel of the first replica in it, and its outputs and
errors come back on that channel as before (`replicas/core_channels.py`). The replica's process
and Ray's per-request messages are off the request's path as they already were off its tokens'.

What the Ray call did, the channel does too:
- routing: the router's own decision, counted against the replica that took the request, and
  released when the request ends, so later decisions see it;
- `max_ongoing_requests`: the core takes a request only while it holds fewer than its replica's
  limit (Ray's calls included); a core that refuses (full, or draining) sends the request down
  the ranking, and past the replicas with a channel it goes by Ray, which queues it, counts it for
  autoscaling, and answers 429 past `max_queued_requests`;
- cancellation: an abort on the channel (the client left);
- errors: the request's own error on the channel; a channel that breaks (the replica died) fails
  exactly the requests sent on it.

And more than the Ray call did: each step's frame carries the core's queue as of that step
(`replicas.cache_digest.StepReport`: its requests, arrivals and prompt blocks queued for
prefill), which the router takes as the replica's at once (`observe_step`), instead of guessing
other ingresses' sends from its own until the next digest, a second later.

A replica with no channel here yet stops the walk down the ranking: the request goes by Ray, to
that replica, and its reply opens the channel for the requests after it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from replicas import core_wire
from replicas.deployment import GenerateRequest
from replicas.outputs import RequestOutput
from serve_app.routing import replica_events


class CoreLink:
    """This ingress's open channel to one engine core: its writing end, and the requests that
    were sent on it and have not ended (they fail with it)."""

    def __init__(self, replica_id: str, writer: asyncio.StreamWriter):
        self.replica_id = replica_id
        self.writer = writer
        self.requests: set[str] = set()
        self.closed = False

    def add(self, request: GenerateRequest) -> None:
        self.requests.add(request.request_id)
        self.writer.write(core_wire.channel_add(
            request.request_id, request.prompt_token_ids, request.prompt,
            request.block_hashes or None, request.params, request.priority))

    def abort(self, request_id: str) -> None:
        if request_id in self.requests:
            self.requests.discard(request_id)
            if not self.closed:
                self.writer.write(core_wire.channel_abort([request_id]))


@dataclass(slots=True)
class Dispatched:
    """One request on one core's channel, as the router counted it."""

    link: CoreLink
    router: object
    block_hashes: list[int]
    at: float

    def refused(self, request_id: str) -> None:
        self.link.requests.discard(request_id)
        self.router.state.refused(request_id, self.link.replica_id, self.block_hashes, self.at)

    def ended(self, request_id: str, aborted: bool) -> None:
        if aborted:
            self.link.abort(request_id)
        else:
            self.link.requests.discard(request_id)
        self.router.state.completed(request_id)


class CoreDispatch:
    """Where this ingress may send a request without Ray: the router's ranking, walked while the
    replicas in it have a core channel here."""

    def __init__(self, links: dict[str, CoreLink], deployment: str, enabled: bool):
        self.links = links  # replica id -> its open core channel (OutputChannels owns them)
        self.deployment = deployment
        if enabled:
            # The router runs on this event loop (Ray's "throughput optimized" placement, which
            # serve_app/app.py sets); on a loop of its own its state would be shared by threads.
            from ray.serve._private import constants
            enabled = not constants.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP
        self.enabled = enabled
        self._router = None

    def router(self):
        if self._router is None:
            from ray import serve
            self._router = replica_events.router_of(serve.get_replica_context().app_name,
                                                    self.deployment)
        return self._router

    def first_output(self, call_id: str | None) -> None:
        """A request's first output came (its prompt is prefilled), on a channel (call_id: its
        request id) or on its Ray call (Ray's id of the call): the router, where it runs on this
        loop, counts its prompt as queued no longer."""
        router = self.router() if self.enabled and call_id else None
        if router is not None:
            router.state.first_output(call_id)

    def observe_step(self, replica_id: str, batch: list[tuple], step_report: tuple,
                     call_of: Mapping[str, str]) -> None:
        """A core's step as its frame here carries it (`RequestOutput.wire()` values, and its
        `replicas.cache_digest.StepReport`) to the router: the requests with an output in it
        and those that finished in it (by the id the router knows each by: Ray's id of the
        call that carried it, or ours for those sent here), then the report."""
        router = self.router() if self.enabled else None
        if router is not None:
            ids = [call_of.get(values[0], values[0]) for values in batch]
            finished = RequestOutput.finished_on_wire
            router.state.observe_step(
                replica_id, ids, [i for i, values in zip(ids, batch) if finished(values)],
                step_report)

    def sends(self, request: GenerateRequest) -> Iterator[Dispatched]:
        """Send the request to the replicas it ranks first, one at a time: each yielded send
        that the caller finds refused (`Dispatched.refused`) moves on to the next. Ends, with
        nothing more sent, at a replica with no channel here (the request then goes by Ray)."""
        if not self.enabled or not self.links:
            return
        router = self.router()
        hashes = request.block_hashes
        decision = router.choose_for_dispatch(hashes) if router is not None else None
        if decision is None:
            return
        for replica_id in decision.ranking():
            link = self.links.get(replica_id)
            if link is None or link.closed:
                return
            at = router.dispatched(request.request_id, replica_id, hashes, decision)
            link.add(request)
            yield Dispatched(link, router, hashes, at)
