"""The router's fast structures against plain models of them (`tests/unit/routing_reference.py`):
the inverted index against a scan of every replica, the maintained loads against counting."""
import random

import pytest

from pagedserve.replicas.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVSnapshot,
                                encode_event, wire_stream)
from pagedserve.serve_app.routing.load import LoadTracker
from pagedserve.serve_app.routing.prefix_index import LAZY_MIN_BLOCKS, RUN_MIN_BLOCKS, PrefixIndex
from tests.unit.routing_reference import CountingLoadTracker, ScanPrefixIndex

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
    model = ScanPrefixIndex(optimistic_ttl_s=3.0)
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
            model.observe(replica_id, stream, now)
        elif op < 0.7:
            hashes = random_query(rng)
            held = model.match(hashes, [replica_id])[replica_id]
            new.insert(replica_id, hashes, now, held)
            model.insert(replica_id, hashes, now)
            inserts.append((replica_id, hashes, now))
        elif op < 0.8 and inserts:
            r, hashes, at = rng.choice(inserts)
            new.remove(r, hashes, at)
            model.remove(r, hashes, at)
        elif op < 0.83:
            live = rng.sample(ids, 4)
            new.retain(live)
            model.retain(live)
        for _ in range(3):
            query = random_query(rng)
            live = rng.sample(ids, rng.randrange(1, 6))
            lazy_matches += bool(query) and query[0] in new._lazy
            assert new.match(query, live) == model.match(query, live)
        for h in rng.choice(CHAINS)[:4]:
            assert new.holders(h) == model.holders(h)
        assert all(new.in_sync(r) == model.in_sync(r) for r in ids)
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
    new, model = LoadTracker(), CountingLoadTracker()
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
                continue  # one older than the last is ignored (the model would apply it)
            last_report[r] = report_time
            new.report(r, depth, report_time)
            model.report(r, depth, report_time)
        elif op < 0.6:
            q, r = rng.choice(requests), rng.choice(ids)
            assert new.sent(q, r, now) == model.sent(q, r, now)
        elif op < 0.97:
            q = rng.choice(requests)
            new.completed(q)
            model.completed(q)
        else:
            live = rng.sample(ids, 2)
            new.retain(live)
            model.retain(live)
        for r in ids:
            assert new.load(r) == model.load(r)
            assert new.num_sent_since_report(r) == model.num_sent_since_report(r)
        assert {r: v for r, v in new.loads.items()} == {r: new.load(r) for r in new.loads}
