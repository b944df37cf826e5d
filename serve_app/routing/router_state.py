"""Everything the prefix-affinity router knows, without Ray: the prefix index and the loads. The
ingress's `EngineClient` feeds it the cores' digests and step reports and asks it for rankings,
so the whole behaviour is testable with fake replicas.
"""
from __future__ import annotations

import random
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pagedserve.replicas.core.cache_digest import DIGEST_VERSION, QueueDepth
from pagedserve.serve_app.routing.load import LoadTracker
from pagedserve.serve_app.routing.policy import (
    AFFINITY, FALLBACK, LOAD_OVERRIDE, Decision, RoutingSettings, rank_replicas,
)
from pagedserve.serve_app.routing.prefix_index import PrefixIndex
from pagedserve.serve_app.routing.rendezvous import ReplicaSet


# Adapters whose recent sends the router remembers before it drops those past the optimistic TTL.
MAX_ADAPTERS_SENT = 256


class RouterState:
    def __init__(self, settings: RoutingSettings | None = None, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time):
        self.settings = settings or RoutingSettings()
        self.index = PrefixIndex(self.settings.optimistic_ttl_s)
        self.loads = LoadTracker(listener=self._load_changed)
        self.hit_rates: dict[str, float] = {}
        self._rng = rng or random.Random()
        self._clock = clock
        self._digest_time: dict[str, float] = {}
        self._replicas = ReplicaSet(())  # the last live set a decision ranked
        self.adapters: dict[str, frozenset[int]] = {}  # replica -> LoRA adapter ids it holds
        self._adapter_sent: dict[int, dict[str, float]] = {}  # adapter -> replica -> last sent

    # -- what replicas tell us ------------------------------------------------------------------
    def observe(self, replica_id: str, digest: Mapping[str, Any] | None) -> bool:
        """Apply a replica's digest (its routing stats) if it is newer than the last one applied."""
        if not digest or digest.get("version") != DIGEST_VERSION:
            return False
        report_time = float(digest["time"])
        if report_time <= self._digest_time.get(replica_id, float("-inf")):
            return False
        self._digest_time[replica_id] = report_time
        self.index.observe(replica_id, digest.get("kv_events"), report_time)
        self.loads.report(replica_id, QueueDepth.from_stats(digest).num_requests, report_time,
                          digest.get("num_arrived"))
        self.hit_rates[replica_id] = float(digest.get("prefix_cache_hit_rate", 0.0))
        self.adapters[replica_id] = frozenset(digest.get("lora_resident_ids") or ())
        return True

    def observe_step(self, replica_id: str, with_output: Iterable[str],
                     finished: Iterable[str], report: Sequence) -> None:
        """One engine step of replica_id, as its outputs to this ingress carry it: its requests
        that had an output in it (so their prompts are prefilled) and those that finished in it
        (by the ids this router knows them by), then its `pagedserve.replicas.core.cache_digest.StepReport`. The
        finished end now, as of the report's time, so that the report's count is not taken
        from again as each request's stream closes later (once per send's weight: see
        `LoadTracker`); then the replica's load and prompt blocks queued for prefill are the
        report's."""
        loads = self.loads
        for request_id in with_output:
            loads.prefilled(request_id)
        report_time, num_requests, num_arrived, queued_prefill_blocks = report
        for request_id in finished:
            loads.completed(request_id, report_time)
        loads.report(replica_id, num_requests, report_time, num_arrived, queued_prefill_blocks)

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        live = set(live_replica_ids)
        if live == set(self._digest_time) and live >= self.index.replica_ids:
            return
        self.index.retain(live)
        self.loads.retain(live)
        for table in (self._digest_time, self.hit_rates, self.adapters, *self._adapter_sent.values()):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    # -- what the router does -------------------------------------------------------------------
    def choose(self, request_id: str | None, block_hashes: Sequence[int],
               live_replica_ids: Iterable[str], adapter_id: int = 0) -> Decision:
        """Rank the live replicas for a request; with a request id, count it against the first
        choice now (`dispatched`), so a burst routed before the next digest sees its own effect.

        A request for a LoRA adapter (`adapter_id`) is ranked among the replicas that hold it
        first (its prefixes are its own, so affinity within them is exact), unless even the
        least loaded of them exceeds the least-loaded replica by more than
        `adapter_max_excess_load`: then the adapter spreads to the rest. The others follow in
        the ranking, for when the holders refuse."""
        live = self._replica_set(live_replica_ids)
        holders = self._holders(adapter_id, live) if adapter_id else None
        if holders:
            others = tuple(r for r in live.ids if r not in holders)
            decision = self._rank(block_hashes, ReplicaSet(holders, self.loads.loads))
            if others:
                decision.rest = _then(decision.rest, lambda: self._rank(
                    block_hashes, ReplicaSet(others, self.loads.loads)).ranked)
        else:
            decision = self._rank(block_hashes, live)
        if request_id is not None:
            self.dispatched(request_id, decision.replica_id, block_hashes, decision, adapter_id)
        return decision

    def _rank(self, block_hashes: Sequence[int], replicas: ReplicaSet) -> Decision:
        match = self.index.prefix_match(block_hashes, replicas.ids_set)
        return rank_replicas(block_hashes, replicas, match, self.settings, self._rng,
                             self.loads.queued_prefill)

    def _holders(self, adapter_id: int, live: ReplicaSet) -> tuple[str, ...] | None:
        """The live replicas holding the adapter (or sent it within the optimistic TTL), if any
        is loaded little enough to take it."""
        horizon = self._clock() - self.settings.optimistic_ttl_s
        sent = self._adapter_sent.get(adapter_id, {})
        holders = tuple(r for r in live.ids if adapter_id in self.adapters.get(r, ())
                        or sent.get(r, horizon) > horizon)
        if not holders:
            return None
        least = float(live.loads.min())
        if min(self.loads.load(r) for r in holders) - least > self.settings.adapter_max_excess_load:
            return None
        return holders

    def dispatched(self, request_id: str, replica_id: str, block_hashes: Sequence[int],
                   decision: Decision, adapter_id: int = 0) -> tuple[str, float]:
        """A request sent to replica_id (a rank of `decision`): counted there from now. (The
        reason to count it under, when it was counted: for `refused`.)"""
        now = self._clock()
        if adapter_id:
            self.adapter_sent(adapter_id, replica_id)
        first = replica_id == decision.replica_id
        matched = decision.num_matched_blocks if first else 0
        self.index.insert(replica_id, kept_hashes(block_hashes), now, matched)
        self.loads.sent(request_id, replica_id, now, len(block_hashes) - matched)
        if first:
            return decision.reason, now
        return (LOAD_OVERRIDE if decision.reason == AFFINITY else FALLBACK), now

    def adapter_sent(self, adapter_id: int, replica_id: str) -> None:
        """replica_id was sent the adapter (a request for it, or a load): it holds it from now,
        for the optimistic TTL or until its digests say so."""
        now = self._clock()
        if adapter_id not in self._adapter_sent and len(self._adapter_sent) >= MAX_ADAPTERS_SENT:
            horizon = now - self.settings.optimistic_ttl_s  # ids are never reused: drop the stale
            for stale in [a for a, sent in self._adapter_sent.items()
                          if max(sent.values(), default=horizon) <= horizon]:
                del self._adapter_sent[stale]
        self._adapter_sent.setdefault(adapter_id, {})[replica_id] = now

    def refused(self, request_id: str, replica_id: str, block_hashes: Sequence[int],
                dispatched_at: float) -> None:
        """replica_id did not take a dispatched request: take back what `dispatched` counted."""
        self.index.remove(replica_id, block_hashes, dispatched_at)
        self.loads.unsent(request_id)

    def first_output(self, request_id: str) -> None:
        """The request's first output reached the ingress: its prompt is prefilled."""
        self.loads.prefilled(request_id)

    def completed(self, request_id: str) -> None:
        self.loads.completed(request_id, self._clock())

    def load(self, replica_id: str) -> float:
        return self.loads.load(replica_id)

    # -- internals ------------------------------------------------------------------------------
    def _replica_set(self, live_replica_ids: Iterable[str]) -> ReplicaSet:
        """The same replicas as last time, mostly: comparing the ids is cheaper than sorting, and
        the same tuple (immutable) needs no comparing."""
        if live_replica_ids is self._replicas.key:
            return self._replicas
        live = tuple(live_replica_ids)
        if live != self._replicas.key:
            self._replicas = ReplicaSet(live, self.loads.loads)
        else:
            self._replicas.key = live  # the caller may pass this very tuple next time
        return self._replicas

    def _load_changed(self, replica_id: str, load: float) -> None:
        self._replicas.set_load(replica_id, load)


def _then(first: Callable[[], list[str]], second: Callable[[], list[str]]) -> Callable[[], list[str]]:
    return lambda: [*first(), *second()]


def kept_hashes(block_hashes: Sequence[int]) -> Sequence[int]:
    """A request's hashes as the index keeps them (for its TTL): an int64 array, whose items the
    garbage collector never visits. A list of them cost every young collection in this process a visit to
    each of its hundreds of int objects (cache misses, and collections come often at a thousand
    replicas). A tuple where a hash is beyond int64 (block hashes never are)."""
    try:
        return array("q", block_hashes)
    except OverflowError:
        return tuple(block_hashes)
