"""The KV event stream end to end: a real BlockManager's events, published as a replica does,
pickled as Ray does, mirrored as the router does, must equal the block manager's cache."""
import pickle
import random
import sys
import threading

import pytest

from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.core.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog, KVEventPublisher, KVSnapshot,
    decode_event, encode_event, take_snapshot, wire_stream,
)
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.sequence import Sequence
from pagedserve.serve_app.routing.cache_mirror import CacheMirror
from pagedserve.serve_app.routing.prefix_index import PrefixIndex

BS = 4


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_log_numbers_events_and_drops_the_oldest():
    log = KVEventLog(capacity=3)
    for h in range(5):
        log.append(BlockRemoved([h]))
    assert log.next_seq == 5
    assert log.since(2) == [BlockRemoved([2]), BlockRemoved([3]), BlockRemoved([4])]
    assert log.since(5) == []
    assert log.since(1) is None  # dropped: the reader must resync
    assert log.since(6) is None


def test_log_forgets_events_older_than_it_retains():
    clock = Clock()
    log = KVEventLog(capacity=100, retain_s=30.0, clock=clock)
    for second in range(40):
        clock.now = float(second)
        log.append(BlockRemoved([second]))
    assert log.since(9) == [BlockRemoved([h]) for h in range(9, 40)]  # at most 30 s old
    assert log.since(8) is None  # forgotten: the reader must resync


def test_events_survive_the_wire():
    for event in (BlockStored([1, 2], None), BlockStored([3], 2), BlockRemoved([4]),
                  AllBlocksCleared()):
        wire = pickle.loads(pickle.dumps(encode_event(7, event)))
        assert wire[0] == 7 and decode_event(wire) == event


def publisher(bm, clock, **kw):
    return KVEventPublisher(bm, clock=clock, **{"window_s": 3.0, "snapshot_period_s": 60.0, **kw})


def stored(bm, *hashes):
    bm.cached.update({h: 0 for h in hashes})  # the order the block manager keeps: cache, then log
    bm.kv_events.append(BlockStored(list(hashes), None))


def test_reports_carry_a_window_of_events_and_snapshots_only_when_due():
    bm, clock = BlockManager(num_blocks=4, block_size=BS), Clock()
    pub = publisher(bm, clock)
    stored(bm, 1)
    assert pub.report() == wire_stream(1, [], KVSnapshot(1, [1]))  # first: a snapshot
    clock.now = 1.0
    stored(bm, 2)
    assert pub.report() == wire_stream(2, [(1, "BlockStored", [2], None)], None)
    clock.now = 2.0
    stored(bm, 3)  # the report at 0.0 is the newest one at least 3 s old: events from its head
    assert pub.report() == wire_stream(3, [(1, "BlockStored", [2], None),
                                           (2, "BlockStored", [3], None)], None)
    clock.now = 4.0  # now the one at 1.0 is
    assert pub.report() == wire_stream(3, [(2, "BlockStored", [3], None)], None)
    assert pub.report(force_snapshot=True)["snapshot"] == {"seq": 3, "block_hashes": [1, 2, 3]}
    clock.now = 59.0
    assert pub.report()["snapshot"] is None  # a forced snapshot does not put the next one off
    clock.now = 60.0
    assert pub.report()["snapshot"] == {"seq": 3, "block_hashes": [1, 2, 3]}


def test_a_window_the_log_no_longer_holds_comes_with_a_snapshot():
    bm, clock = BlockManager(num_blocks=4, block_size=BS, max_events=2), Clock()
    pub = publisher(bm, clock)
    pub.report()
    clock.now = 1.0
    for h in (1, 2, 3):
        stored(bm, h)
    stream = pub.report()
    assert stream["snapshot"] == {"seq": 3, "block_hashes": [1, 2, 3]}
    assert stream["seq"] == 3 and stream["events"] == []


# -- the property: random block-manager traffic, mirrored exactly -------------------------------
PREFIXES = [[100 + p] * (3 * BS) for p in range(3)]  # three shared 3-block "system prompts"


class Traffic:
    """Scheduler-like use of a real BlockManager: admit with prefix hits and chunked prefill, grow
    by chunks and decode tokens, preempt when blocks run out, finish, now and then reset."""

    def __init__(self, rng: random.Random, bm: BlockManager):
        self.rng, self.bm, self.running, self.num_requests = rng, bm, [], 0

    def admit(self):
        # A tiny vocabulary, so unrelated prompts share blocks and content repeats.
        tokens = self.rng.choice(PREFIXES)[:self.rng.randint(0, 3 * BS)]
        tokens = tokens + [self.rng.randrange(3) for _ in range(self.rng.randint(1, 3 * BS))]
        self.num_requests += 1
        seq = Sequence(f"r{self.num_requests}", tokens, SamplingParams(max_tokens=64), BS)
        blocks, num_cached = self.bm.get_computed_blocks(seq)
        num_new = min(seq.num_tokens - num_cached, self.rng.randint(1, 3 * BS))
        if self.bm.allocate_slots(seq, num_new, blocks):
            seq.num_computed_tokens = num_cached + num_new
            self.running.append(seq)

    def step(self):
        seq = self.rng.choice(self.running)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(self.rng.randrange(3))
        num_new = min(seq.num_tokens - seq.num_computed_tokens, self.rng.randint(1, 2 * BS))
        if self.bm.allocate_slots(seq, num_new):
            seq.num_computed_tokens += num_new
        else:  # preempted
            self.finish(seq)

    def finish(self, seq=None):
        seq = seq or self.rng.choice(self.running)
        self.running.remove(seq)
        self.bm.free(seq)

    def random_op(self):
        r = self.rng.random()
        if r < 0.002:
            self.bm.reset_prefix_cache()
        elif not self.running or r < 0.3:
            self.admit()
        elif r < 0.8:
            self.step()
        else:
            self.finish()


def mirror_equals_cache(mirror: CacheMirror, bm: BlockManager) -> bool:
    return mirror.block_hashes == set(bm.cached)


def replay(seed: int) -> tuple[int, int]:
    """Random traffic with reports now and then, some of them never reaching the router.
    Returns (holes seen, reports checked exact)."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.randint(6, 40), block_size=BS,
                      max_events=rng.choice([8, 32, 10_000]))
    clock = Clock()
    pub = publisher(bm, clock, snapshot_period_s=20.0)
    mirror, traffic, num_exact = CacheMirror(), Traffic(rng, bm), 0
    for _ in range(400):
        for _ in range(rng.randint(0, 12)):
            traffic.random_op()
        clock.now += rng.uniform(0.2, 2.0)
        stream = pickle.loads(pickle.dumps(pub.report()))
        if rng.random() < 0.15:
            continue  # this router missed the report
        mirror.apply(stream)
        if mirror.in_sync:
            assert mirror_equals_cache(mirror, bm)
            num_exact += 1
    clock.now += 20.0  # whatever happened, the next scheduled snapshot makes the mirror exact
    mirror.apply(pub.report())
    assert mirror.in_sync and mirror_equals_cache(mirror, bm)
    index = PrefixIndex()  # and the router's index says the same
    index.observe("r1", pub.report(force_snapshot=True), report_time=1.0)
    assert index.num_blocks("r1") == len(bm.cached)
    assert all(index.holds("r1", h) for h in bm.cached)
    return mirror.num_holes, num_exact


@pytest.mark.parametrize("seed", range(12))
def test_mirror_is_exact_after_any_mix_of_stores_evictions_and_clears(seed):
    replay(seed)


def test_the_property_exercises_holes_and_resyncs():
    results = [replay(seed) for seed in range(12)]
    assert sum(holes for holes, _ in results) > 0
    assert all(num_exact > 100 for _, num_exact in results)


def test_snapshot_taken_between_a_change_and_its_event_is_still_exact():
    """The reader thread can copy `cached` after the engine changed it but before it logged the
    event; replaying from the snapshot's number must still land on the cache exactly."""
    rng = random.Random(7)
    bm = BlockManager(num_blocks=24, block_size=BS)
    snapshots = []

    class Interleaved(KVEventLog):
        def append(self, event):
            if rng.random() < 0.3:
                snapshots.append(take_snapshot(bm))  # the reader runs right here
            super().append(event)

    bm.kv_events = Interleaved()
    traffic = Traffic(rng, bm)
    for _ in range(2000):
        traffic.random_op()
    assert len(snapshots) > 100
    for snapshot in snapshots:
        events = bm.kv_events.since(snapshot.seq)
        mirror = CacheMirror()
        mirror.apply(wire_stream(snapshot.seq + len(events),
                                 [encode_event(snapshot.seq + i, e) for i, e in enumerate(events)],
                                 snapshot))
        assert mirror.in_sync and mirror_equals_cache(mirror, bm)


def test_reports_from_another_thread_while_the_engine_steps():
    rng = random.Random(3)
    bm = BlockManager(num_blocks=64, block_size=BS)
    ticks = iter(range(10**9))
    pub = publisher(bm, lambda: float(next(ticks)))  # a second passes each report: 3-report windows
    traffic, mirror, done = Traffic(rng, bm), CacheMirror(), threading.Event()

    def engine():
        for _ in range(20_000):
            traffic.random_op()
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, to interleave the two at many points
    try:
        thread = threading.Thread(target=engine)
        thread.start()
        while not done.is_set():
            mirror.apply(pub.report())
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    mirror.apply(pub.report())
    assert mirror.in_sync and mirror_equals_cache(mirror, bm)


def test_kv_events_imports_neither_torch_nor_ray():
    import subprocess
    code = ("import sys, pagedserve.replicas.core.kv_events, pagedserve.replicas.core.block_manager;"
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
