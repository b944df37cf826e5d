"""The router's fast paths against the algorithm they replaced (`bench.router_baseline`): the
inverted index against per-replica scans, the maintained loads against counting, and whole
decisions (first choice, reason, full ranking) on random fleets, given the same rendezvous weight."""
import random

import pytest

from bench.router_baseline import OldLoadTracker, OldPrefixIndex, OldRouterState
from replicas.cache_digest import DIGEST_VERSION
from replicas.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVSnapshot,
                                encode_event, wire_stream)
from serve_app.routing.load import LoadTracker
from serve_app.routing.policy import RoutingSettings, rendezvous_weight
from serve_app.routing.prefix_index import LAZY_MIN_BLOCKS, RUN_MIN_BLOCKS, PrefixIndex
from serve_app.routing.router_state import RouterState

CHAINS = [[1000 * c + b for b in range(12)] for c in range(6)]  # six 12-block prompts


class Stream:
    """A replica's KV event stream as its digests carry it: numbered events, an occasional
    snapshot, and (sometimes) a report that skips events (a hole)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.seq = 0
        self.cached: set[int] = set()

    def report(self) -> dict:
        rng = self.rng
        if rng.random() < 0.1:  # a snapshot
            self.cached = {h for chain in rng.sample(CHAINS, 2) for h in chain[:rng.randrange(13)]}
            return wire_stream(self.seq, [], KVSnapshot(self.seq, sorted(self.cached)))
        events = []
        for _ in range(rng.randrange(4)):
            kind = rng.random()
            if kind < 0.55:
                chain = rng.choice(CHAINS)
                start = rng.randrange(12)
                hashes = chain[start:start + rng.randrange(1, 6)]
                event = BlockStored(hashes, chain[start - 1] if start else None)
                self.cached.update(hashes)
            elif kind < 0.95 and self.cached:
                hashes = rng.sample(sorted(self.cached), min(len(self.cached), rng.randrange(1, 4)))
                event = BlockRemoved(hashes)
                self.cached.difference_update(hashes)
            else:
                event = AllBlocksCleared()
                self.cached.clear()
            events.append(encode_event(self.seq, event))
            self.seq += 1
        if events and rng.random() < 0.05:  # this report lost its first event: a hole
            events = events[1:]
        return wire_stream(self.seq, events, None)


def random_query(rng: random.Random) -> list[int]:
    chain = rng.choice(CHAINS)
    cut = rng.randrange(13)
    return chain[:cut] + [rng.randrange(10 ** 9, 2 * 10 ** 9) for _ in range(rng.randrange(3))]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("run_min_blocks", [RUN_MIN_BLOCKS, 2])  # 2: runs remembered, forgotten
@pytest.mark.parametrize("lazy_min_blocks", [LAZY_MIN_BLOCKS, 1])  # 1: fresh tails wait lazily
def test_the_inverted_index_matches_a_scan_of_every_replica(seed, run_min_blocks, lazy_min_blocks):
    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(5)]
    new = PrefixIndex(optimistic_ttl_s=3.0, run_min_blocks=run_min_blocks,
                      lazy_min_blocks=lazy_min_blocks)
    old = OldPrefixIndex(optimistic_ttl_s=3.0)
    streams = {r: Stream(rng) for r in ids}
    inserts = []
    now = 0.0
    lazy_matches = 0
    for _ in range(300):
        now += rng.random()
        replica_id = rng.choice(ids)
        op = rng.random()
        if op < 0.4:
            stream = streams[replica_id].report()
            new.observe(replica_id, stream, now)
            old.observe(replica_id, stream, now)
        elif op < 0.7:
            hashes = random_query(rng)
            held = old.match(hashes, [replica_id])[replica_id]
            new.insert(replica_id, hashes, now, held)
            old.insert(replica_id, hashes, now)
            inserts.append((replica_id, hashes, now))
        elif op < 0.8 and inserts:
            r, hashes, at = rng.choice(inserts)
            new.remove(r, hashes, at)
            old.remove(r, hashes, at)
        elif op < 0.83:
            live = rng.sample(ids, 4)
            new.retain(live)
            old.retain(live)
        for _ in range(3):
            query = random_query(rng)
            live = rng.sample(ids, rng.randrange(1, 6))
            lazy_matches += bool(query) and query[0] in new._lazy
            assert new.match(query, live) == old.match(query, live)
        for h in rng.choice(CHAINS)[:4]:
            assert new.holders(h) == old.holders(h)
        assert all(new.in_sync(r) == old.in_sync(r) for r in ids)
    every = {h for chain in CHAINS for h in chain}
    assert {h for h in new._holders} <= every | {h for _, q, _ in inserts for h in q}
    new.runs.settle()
    assert set(new.runs.root_of) <= set(new._holders)  # what runs point at stays within the index
    if run_min_blocks == 2 and lazy_min_blocks == LAZY_MIN_BLOCKS:
        assert new.runs.by_root  # the walk skipped remembered runs (lazy tails leave fewer to remember)
    if lazy_min_blocks == 1:
        assert lazy_matches  # matches compared a lazy tail by position


@pytest.mark.parametrize("seed", range(5))
def test_maintained_loads_equal_counting_the_requests_in_flight(seed):
    rng = random.Random(seed)
    ids = ["a", "b", "c"]
    new, old = LoadTracker(), OldLoadTracker()
    requests = [f"q{i}" for i in range(40)]
    now = 0.0
    last_report: dict[str, float] = {}
    for _ in range(600):
        now += rng.random() * 0.3
        op = rng.random()
        if op < 0.15:
            r = rng.choice(ids)
            depth = rng.randrange(6)
            report_time = now - rng.random()  # a report may predate sends already made
            if report_time <= last_report.get(r, -1.0):
                continue  # one older than the last is ignored (the old tracker applied it)
            last_report[r] = report_time
            new.report(r, depth, report_time)
            old.report(r, depth, report_time)
        elif op < 0.6:
            q, r = rng.choice(requests), rng.choice(ids)
            assert new.sent(q, r, now) == old.sent(q, r, now)
        elif op < 0.97:
            q = rng.choice(requests)
            new.completed(q)
            old.completed(q)
        else:
            live = rng.sample(ids, 2)
            new.retain(live)
            old.retain(live)
        for r in ids:
            assert new.load(r) == old.load(r)
            assert new.num_sent_since_report(r) == old.num_sent_since_report(r)
        assert {r: v for r, v in new.loads.items()} == {r: new.load(r) for r in new.loads}


def test_the_ttl_drops_requests_never_seen_finishing_oldest_first(monkeypatch):
    import serve_app.routing.load as load_module
    monkeypatch.setattr(load_module, "MAX_IN_FLIGHT", 4)
    loads = LoadTracker()
    for i in range(4):
        loads.sent(f"old{i}", "r1", now=float(i))
    loads.sent("old0", "r2", now=5.0)  # moved: now the newest send
    loads.sent("new", "r1", now=load_module.IN_FLIGHT_TTL_S + 2.5)
    # old1, old2 are past the TTL; old3 (sent at 3.0) and the moved old0 are not
    assert (loads.load("r1"), loads.load("r2")) == (2, 1)


def digest(t: float, stream: dict, waiting: int, running: int) -> dict:
    return {"version": DIGEST_VERSION, "time": t, "block_size": 4, "kv_events": stream,
            "num_waiting": waiting, "num_running": running, "kv_cache_usage": 0.0,
            "prefix_cache_hit_rate": 0.0}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("settings", [RoutingSettings(cold_home_pair_slack=None), RoutingSettings(
    load_override_threshold=2, cold_home_max_excess_load=1, cold_home_blocks=2,
    cold_home_pair_slack=None)])  # the old algorithm's cold home: no pair check
@pytest.mark.parametrize("run_min_blocks", [RUN_MIN_BLOCKS, 2])
@pytest.mark.parametrize("lazy_min_blocks", [LAZY_MIN_BLOCKS, 1])
def test_decisions_are_those_of_the_old_algorithm_on_random_fleets(seed, settings, run_min_blocks,
                                                                   lazy_min_blocks):
    rng = random.Random(seed)
    ids = [f"replica-{i:03d}" for i in range(rng.choice([1, 2, 7, 40]))]
    clock_new, clock_old = Clock(), Clock()
    new = RouterState(settings, rng=random.Random(seed), clock=clock_new)
    new.index.run_min_blocks = run_min_blocks
    new.index.lazy_min_blocks = lazy_min_blocks
    old = OldRouterState(settings, rng=random.Random(seed), clock=clock_old,
                         weight_fn=rendezvous_weight)
    streams = {r: Stream(rng) for r in ids}
    in_flight = []
    for i in range(250):
        now = i * 0.05
        clock_new.now = clock_old.now = now
        if rng.random() < 0.2:
            r = rng.choice(ids)
            d = digest(now, streams[r].report(), rng.randrange(4), rng.randrange(30))
            assert new.observe(r, d) == old.observe(r, d)
        live = ids if rng.random() < 0.8 else rng.sample(ids, max(1, len(ids) - 1))
        query = random_query(rng) if rng.random() < 0.9 else []
        ours = new.choose(None, query, live)
        ranked, reason, num_matched = old.choose(f"q{i}", query, live)
        assert (ours.ranked, ours.reason, ours.num_matched_blocks) == (ranked, reason, num_matched)
        taken = ranked[0] if rng.random() < 0.85 else ranked[-1]  # the first choice may be full
        # The ingress sends to the first choice; a full one refuses, and it goes down the ranking.
        reason, at = new.dispatched(f"q{i}", ranked[0], query, ours)
        if taken != ranked[0]:
            new.refused(f"q{i}", ranked[0], query, at)
            reason, _ = new.dispatched(f"q{i}", taken, query, ours)
        assert reason == old.routed(f"q{i}", taken)
        new.first_output(f"q{i}")  # no prefill left queued: the old fallback compared loads alone
        in_flight.append(f"q{i}")
        while in_flight and rng.random() < 0.45:
            done = in_flight.pop(rng.randrange(len(in_flight)))
            new.completed(done)
            old.completed(done)
