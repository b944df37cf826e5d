import pytest

from pagedserve.replicas.core.block_hash import block_hashes
from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.core.cache_digest import (
    DIGEST_VERSION, QueueDepth, RoutingReporter, autoscaling_stats,
)
from pagedserve.replicas.core.kv_events import KVSnapshot, wire_stream
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.sequence import Sequence

BS = 4


def admitted(bm, tokens):
    seq = Sequence("r", list(tokens), SamplingParams(max_tokens=4), BS)
    blocks, cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - cached, blocks)
    seq.num_computed_tokens = seq.num_tokens
    return seq


class FakeCore:
    def __init__(self, bm, stats):
        self.engine = type("E", (), {"block_manager": bm})()
        self._stats = stats

    def stats(self):
        return dict(self._stats)


def test_first_digest_snapshots_cached_hashes_including_free_ones():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = admitted(bm, range(10))
    bm.free(seq)  # free but still cached: still a hit, so still published
    stats = {"num_waiting": 2, "num_running": 1, "kv_cache_usage": 0.25, "prefix_cache_hit_rate": 0.5}
    digest = RoutingReporter(FakeCore(bm, stats), wall_clock=lambda: 123.0).report()
    snapshot = KVSnapshot(1, block_hashes(list(range(10)), BS))
    assert digest == {"version": DIGEST_VERSION, "time": 123.0, "block_size": BS,
                      "kv_events": wire_stream(1, [], snapshot), "num_waiting": 2,
                      "num_running": 1, "kv_cache_usage": 0.25, "num_arrived": None,
                      "prefix_cache_hit_rate": 0.5, "last_generation_time": None,
                      "lora_resident_ids": []}


def test_later_digests_carry_events_not_the_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    reporter = RoutingReporter(FakeCore(bm, {}))
    admitted(bm, range(8))
    reporter.report()
    seq = admitted(bm, range(20, 28))
    stream = reporter.report()["kv_events"]
    assert stream["snapshot"] is None
    assert stream["events"] == [(1, "BlockStored", seq.block_hashes, None)]


def test_queue_depth_counts_kv_pressure_as_queued():
    assert QueueDepth(3, 8, 0.5).autoscaling_depth(0.9) == 3
    assert QueueDepth(3, 8, 0.95).autoscaling_depth(0.9) == pytest.approx(3 + 4)
    assert QueueDepth(3, 8, 1.0).autoscaling_depth(0.9) == pytest.approx(11)
    assert QueueDepth(3, 8, 1.0).num_requests == 11


def test_stats_for_the_router_and_the_autoscaler():
    bm = BlockManager(num_blocks=8, block_size=BS)
    stats = {"num_waiting": 1, "num_running": 2, "kv_cache_usage": 0.0, "num_arrived": 7}
    report = RoutingReporter(FakeCore(bm, stats)).report()
    assert (report["num_running"], report["num_arrived"]) == (2, 7)
    assert autoscaling_stats(stats) == {"queue_depth": 1.0}
    # Requests an ingress holds for this replica, waiting for room, are its queue too.
    assert autoscaling_stats({**stats, "num_queued_at_ingress": 3}) == {"queue_depth": 4.0}


def test_digest_imports_neither_torch_nor_ray():
    import subprocess
    import sys
    code = ("import sys, pagedserve.replicas.core.cache_digest;"
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_engine_without_a_block_manager_publishes_its_queue_only():
    class Bare:
        def stats(self):
            return {"num_waiting": 0, "num_running": 3}

    digest = RoutingReporter(Bare()).report()
    assert digest["kv_events"] is None and digest["num_running"] == 3
