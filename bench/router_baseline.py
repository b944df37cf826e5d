"""The router's decision path as it was before the inverted index (1.0 of the fleet issue): kept
verbatim as the baseline that `bench.router_decision` times in the same run, and that the tests
compare the current router's decisions with. Not used by the server.
"""
from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from replicas.cache_digest import DIGEST_VERSION, QueueDepth
from serve_app.routing.cache_mirror import CacheMirror
from serve_app.routing.policy import (AFFINITY, COLD_HOME, FALLBACK, LOAD_OVERRIDE, RoutingSettings)

MAX_IN_FLIGHT = 65536
IN_FLIGHT_TTL_S = 600.0


def blake2b_weight(key: int, replica_id: str) -> int:
    """The rendezvous weight the old router used."""
    data = key.to_bytes(8, "little", signed=True) + replica_id.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class OldLoadTracker:
    def __init__(self):
        self._reported: dict[str, float] = {}
        self._report_time: dict[str, float] = {}
        self._finished_since_report: dict[str, int] = {}
        self._in_flight: dict[str, dict[str, float]] = {}  # replica -> request id -> sent at
        self._replica_of: dict[str, str] = {}  # request id -> replica

    def report(self, replica_id: str, queue_depth: float, report_time: float) -> None:
        self._reported[replica_id] = queue_depth
        self._report_time[replica_id] = report_time
        self._finished_since_report[replica_id] = 0

    def sent(self, request_id: str, replica_id: str, now: float) -> str | None:
        """Count request_id against replica_id; returns the replica it was counted on before, if it
        moved (a re-route)."""
        previous = self._replica_of.get(request_id)
        if previous == replica_id:
            return None
        if previous is not None:
            self._in_flight.get(previous, {}).pop(request_id, None)
        self._in_flight.setdefault(replica_id, {})[request_id] = now
        self._replica_of[request_id] = replica_id
        if len(self._replica_of) > MAX_IN_FLIGHT:
            self._drop_older_than(now - IN_FLIGHT_TTL_S)
        return previous

    def completed(self, request_id: str) -> None:
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is None:
            return
        sent_at = self._in_flight.get(replica_id, {}).pop(request_id, None)
        report_time = self._report_time.get(replica_id)
        if sent_at is not None and report_time is not None and sent_at <= report_time:
            self._finished_since_report[replica_id] += 1  # it was in the report's count

    def load(self, replica_id: str) -> float:
        reported = max(0.0, self._reported.get(replica_id, 0.0)
                       - self._finished_since_report.get(replica_id, 0))
        return reported + self.num_sent_since_report(replica_id)

    def num_sent_since_report(self, replica_id: str) -> int:
        report_time = self._report_time.get(replica_id, float("-inf"))
        return sum(1 for at in self._in_flight.get(replica_id, {}).values() if at > report_time)

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        live = set(live_replica_ids)
        for replica_id in [r for r in self._in_flight if r not in live]:
            for request_id in self._in_flight.pop(replica_id):
                self._replica_of.pop(request_id, None)
        for table in (self._reported, self._report_time, self._finished_since_report):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    def _drop_older_than(self, horizon: float) -> None:
        for replica_id, requests in self._in_flight.items():
            for request_id in [r for r, at in requests.items() if at < horizon]:
                del requests[request_id]
                self._replica_of.pop(request_id, None)


class OldPrefixIndex:
    def __init__(self, optimistic_ttl_s: float = 10.0):
        self.optimistic_ttl_s = optimistic_ttl_s
        self._mirrors: dict[str, CacheMirror] = {}  # replica -> what its event stream says it holds
        self._optimistic: dict[str, dict[int, float]] = {}  # replica -> hash -> inserted at
        self._report_time: dict[str, float] = {}

    @property
    def replica_ids(self) -> set[str]:
        return set(self._mirrors) | set(self._optimistic)

    def report_time(self, replica_id: str) -> float | None:
        return self._report_time.get(replica_id)

    def in_sync(self, replica_id: str) -> bool:
        """Whether what we know of replica_id's cache is exact (see CacheMirror)."""
        mirror = self._mirrors.get(replica_id)
        return mirror is not None and mirror.in_sync

    def observe(self, replica_id: str, kv_events: Mapping[str, Any] | None,
                report_time: float) -> None:
        """Apply replica_id's digest taken at report_time: its KV event stream, if it caches."""
        mirror = self._mirrors.setdefault(replica_id, CacheMirror())
        if kv_events is not None:
            mirror.apply(kv_events)
        self._report_time[replica_id] = report_time
        optimistic = self._optimistic.get(replica_id)
        if optimistic:
            horizon = report_time - self.optimistic_ttl_s
            for block_hash in [h for h, at in optimistic.items() if at <= horizon]:
                del optimistic[block_hash]

    def insert(self, replica_id: str, block_hashes: Iterable[int], now: float) -> None:
        """Optimistically record that replica_id is about to hold these blocks."""
        optimistic = self._optimistic.setdefault(replica_id, {})
        for block_hash in block_hashes:
            optimistic[block_hash] = now

    def remove(self, replica_id: str, block_hashes: Iterable[int], inserted_at: float) -> None:
        """Take back an optimistic insert made at inserted_at (the request went elsewhere); hashes
        inserted again since, for another request, stay."""
        optimistic = self._optimistic.get(replica_id)
        if optimistic:
            for block_hash in block_hashes:
                if optimistic.get(block_hash) == inserted_at:
                    del optimistic[block_hash]

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone."""
        live = set(live_replica_ids)
        for table in (self._mirrors, self._optimistic, self._report_time):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    def holds(self, replica_id: str, block_hash: int) -> bool:
        return (block_hash in self._confirmed(replica_id)
                or block_hash in self._optimistic.get(replica_id, ()))

    def holders(self, block_hash: int) -> set[str]:
        return {r for r in self.replica_ids if self.holds(r, block_hash)}

    def match(self, block_hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """For each replica: how many leading blocks of the request it holds."""
        matches = {}
        for replica_id in replica_ids:
            confirmed = self._confirmed(replica_id)
            optimistic = self._optimistic.get(replica_id, ())
            num = 0
            for block_hash in block_hashes:
                if block_hash not in confirmed and block_hash not in optimistic:
                    break
                num += 1
            matches[replica_id] = num
        return matches

    def num_blocks(self, replica_id: str) -> int:
        return len(self._confirmed(replica_id) | set(self._optimistic.get(replica_id, ())))

    def _confirmed(self, replica_id: str) -> set[int] | tuple[()]:
        mirror = self._mirrors.get(replica_id)
        return mirror.block_hashes if mirror is not None else ()


def old_choose_replica(block_hashes: Sequence[int], loads: Mapping[str, float],
                   matches: Mapping[str, int], settings: RoutingSettings,
                   rng: random.Random | None = None, weight_fn=blake2b_weight) -> tuple[list[str], str, int]:
    """Rank the live replicas (the keys of `loads`) for one request."""
    if not loads:
        raise ValueError("no live replicas to choose from")
    ids = sorted(loads)
    matched = {r: matches.get(r, 0) for r in ids}
    least = min(loads.values())
    best = max(matched.values())
    common = min(matched.values())
    num_blocks = len(block_hashes)
    # Ties between holders, and a cold prefix's home, are keyed on the first blocks past the part
    # every replica holds, so requests that agree on those blocks agree on the replica.
    key = block_hashes[min(common + settings.cold_home_blocks, num_blocks) - 1] if num_blocks else 0
    weight = {r: weight_fn(key, r) for r in ids}

    def rank(first: str) -> list[str]:
        rest = sorted((r for r in ids if r != first), key=lambda r: (-matched[r], loads[r], -weight[r]))
        return [first, *rest]

    if best - common >= settings.min_affinity_blocks:
        eligible = [r for r in ids if loads[r] - least <= settings.load_override_threshold]
        pick = max(eligible, key=lambda r: (matched[r], -loads[r], weight[r]))
        reason = AFFINITY if matched[pick] == best else LOAD_OVERRIDE
        return (rank(pick), reason, matched[pick])

    if num_blocks:
        home = max(ids, key=lambda r: weight[r])
        guard = settings.cold_home_max_excess_load  # None: no guard
        if guard is None or loads[home] - least <= guard:
            return (rank(home), COLD_HOME, matched[home])

    pick = power_of_two_choices(ids, loads, rng or random)
    return (rank(pick), FALLBACK, matched[pick])


def power_of_two_choices(ids: Sequence[str], loads: Mapping[str, float], rng) -> str:
    if len(ids) == 1:
        return ids[0]
    a, b = rng.sample(list(ids), 2)
    if loads[a] == loads[b]:
        return a
    return a if loads[a] < loads[b] else b


MAX_UNROUTED = 4096
UNROUTED_TTL_S = 60.0


@dataclass(slots=True)
class _Choice:
    replica_id: str
    block_hashes: list[int]
    reason: str
    at: float


class OldRouterState:
    def __init__(self, settings: RoutingSettings | None = None, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time, weight_fn=blake2b_weight):
        self.weight_fn = weight_fn
        self.settings = settings or RoutingSettings()
        self.index = OldPrefixIndex(self.settings.optimistic_ttl_s)
        self.loads = OldLoadTracker()
        self.hit_rates: dict[str, float] = {}
        self._rng = rng or random.Random()
        self._clock = clock
        self._digest_time: dict[str, float] = {}
        self._unrouted: dict[str, _Choice] = {}

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
        self.loads.report(replica_id, QueueDepth.from_stats(digest).num_requests, report_time)
        self.hit_rates[replica_id] = float(digest.get("prefix_cache_hit_rate", 0.0))
        return True

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        live = set(live_replica_ids)
        if live == set(self._digest_time) and live >= self.index.replica_ids:
            return
        self.index.retain(live)
        self.loads.retain(live)
        for table in (self._digest_time, self.hit_rates):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    # -- what the router does -------------------------------------------------------------------
    def choose(self, request_id: str | None, block_hashes: Sequence[int],
               live_replica_ids: Iterable[str]) -> tuple[list[str], str, int]:
        """Rank the live replicas for a request, and count it against the first choice now, so a
        burst routed before the next digest sees its own effect."""
        live = list(live_replica_ids)
        loads = {r: self.loads.load(r) for r in live}
        matches = self.index.match(block_hashes, live)
        decision = old_choose_replica(block_hashes, loads, matches, self.settings, self._rng,
                                      self.weight_fn)
        if request_id is not None:
            self._assign(request_id, decision[0][0], list(block_hashes), decision[1])
        return decision

    def routed(self, request_id: str, replica_id: str) -> str:
        """The request was accepted by replica_id; returns the reason to count it under."""
        choice = self._unrouted.pop(request_id, None)
        if choice is None:
            return FALLBACK
        if replica_id == choice.replica_id:
            return choice.reason
        # The first choice was full and Ray took a lower rank: move our bookkeeping along.
        self.index.remove(choice.replica_id, choice.block_hashes, choice.at)
        self.index.insert(replica_id, choice.block_hashes, self._clock())
        self.loads.sent(request_id, replica_id, self._clock())
        return LOAD_OVERRIDE if choice.reason == AFFINITY else FALLBACK

    def completed(self, request_id: str) -> None:
        self.loads.completed(request_id)
        self._unrouted.pop(request_id, None)

    def load(self, replica_id: str) -> float:
        return self.loads.load(replica_id)

    # -- internals ------------------------------------------------------------------------------
    def _assign(self, request_id: str, replica_id: str, block_hashes: list[int],
                reason: str) -> None:
        now = self._clock()
        previous = self._unrouted.get(request_id)
        if previous is not None and previous.replica_id != replica_id:
            self.index.remove(previous.replica_id, previous.block_hashes, previous.at)
        self.index.insert(replica_id, block_hashes, now)
        self.loads.sent(request_id, replica_id, now)
        self._unrouted[request_id] = _Choice(replica_id, block_hashes, reason, now)
        if len(self._unrouted) > MAX_UNROUTED:
            horizon = now - UNROUTED_TTL_S
            for stale in [r for r, c in self._unrouted.items() if c.at < horizon]:
                del self._unrouted[stale]
