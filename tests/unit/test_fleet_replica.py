"""bench.fleet.replica: the real scheduler and block manager stepped by the cost model."""
import pytest

from bench.fleet.clock import EventQueue
from bench.fleet.cost_model import CostModel
from bench.fleet.replica import ReplicaSettings, Request, SimReplica
from pagedserve.replicas.core.kv_events import STORED
from pagedserve.serve_app.routing.cache_mirror import CacheMirror

MODEL = CostModel(step_overhead_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002)
SETTINGS = ReplicaSettings(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)


def replica():
    q = EventQueue()
    first, done = [], []
    r = SimReplica("r0", SETTINGS, MODEL, q, first.append, done.append)
    return q, r, first, done


def request(name, at, hashes, prompt=16, max_tokens=2):
    return Request(name, at, prompt, max_tokens, list(hashes))


def test_one_request_takes_a_prefill_step_then_decode_steps():
    q, r, first, done = replica()
    a = request("a", 0.0, [1, 2, 3, 4])
    q.at(0.0, lambda: r.add(a))
    q.run(until=5.0)
    assert first == [a] and done == [a]
    assert a.first_token_s == pytest.approx(0.01 + 16 * 0.001)
    assert a.finish_s == pytest.approx(a.first_token_s + 0.01 + 0.002)
    assert r.num_steps == 2 and r.num_output_tokens == 2 and not r.busy


def test_a_shared_prefix_is_a_cache_hit_and_prefills_only_the_rest():
    q, r, first, done = replica()
    a, b = request("a", 0.0, [1, 2, 3, 4]), request("b", 1.0, [1, 2, 3, 9])
    q.at(0.0, lambda: r.add(a))
    q.at(1.0, lambda: r.add(b))
    q.run(until=5.0)
    # at most (16 - 1) // 4 = 3 blocks can hit: the last token is always computed
    assert b.num_cached_tokens == 12
    assert b.first_token_s - 1.0 == pytest.approx(0.01 + 4 * 0.001)
    assert r.block_manager.hit_rate == pytest.approx(12 / 32)


def test_lru_eviction_and_the_digest_carry_the_kv_event_stream():
    q, r, first, done = replica()
    mirror = CacheMirror()
    q.at(0.0, lambda: r.add(request("a", 0.0, [1, 2, 3, 4])))
    q.at(1.0, lambda: mirror.apply(r.record_routing_stats()["kv_events"]))
    # 8 blocks in all: c's 5 blocks evict a's, oldest first
    q.at(2.0, lambda: r.add(request("c", 2.0, [11, 12, 13, 14, 15], prompt=20)))
    q.at(3.0, lambda: mirror.apply(r.record_routing_stats()["kv_events"]))
    q.run(until=1.5)
    assert mirror.block_hashes == {1, 2, 3, 4}
    q.run(until=5.0)
    # a's blocks were freed tail first (its hashless decode block at the head): c's 6 blocks
    # (20 prompt tokens + 2 generated) take that one, the 3 never used, then a's last two
    assert mirror.block_hashes == set(r.block_manager.cached) == {1, 2, 11, 12, 13, 14, 15}
    digest = r.record_routing_stats()
    assert digest["num_waiting"] == 0 and digest["num_running"] == 0
    assert digest["last_generation_time"] == pytest.approx(done[-1].finish_s)
    assert any(e[1] == STORED for e in digest["kv_events"]["events"])
    assert 0 < r.record_autoscaling_stats()["load"] < 0.05  # the steps of the last seconds
    q.run(until=20.0)  # idle since: they have faded
    assert r.record_autoscaling_stats() == {"queue_depth": 0.0, "load": 0.0, "kv_working_set": 0.0}


def test_a_full_batch_queues_and_kv_pressure_counts_in_the_autoscaling_depth():
    q, r, first, done = replica()
    for i in range(6):  # max_num_seqs 4: two wait
        r.add(request(f"q{i}", 0.0, [100 + i], prompt=4, max_tokens=50))
    q.run(until=0.05)
    assert r.scheduler.num_running == 4 and r.scheduler.num_waiting == 2
    assert r.record_autoscaling_stats()["queue_depth"] >= 2
