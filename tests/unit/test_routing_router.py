"""The Ray Serve shim (serve_app.routing.router) and the simulator's copy of it
(bench.fleet.pagedserve_router): digests are read when they change, not per request."""
import asyncio
from types import SimpleNamespace

from bench.fleet.pagedserve_router import PagedServeRouter
from bench.fleet.replica import Request
from replicas.cache_digest import DIGEST_VERSION
from serve_app.routing.policy import RoutingSettings
from serve_app.routing.router import PrefixAffinityRouter
from serve_app.routing.router_state import RouterState


class FakeReplica:
    def __init__(self, replica_id: str, stats: dict):
        self.replica_id = SimpleNamespace(unique_id=replica_id)
        self.stats = stats
        self.reads = 0

    @property
    def routing_stats(self):
        self.reads += 1
        return self.stats


class Metrics:
    def record_load(self, replica_id, load):
        pass


def digest(t, running=0):
    return {"version": DIGEST_VERSION, "time": t, "block_size": 4, "kv_events": None,
            "num_waiting": 0, "num_running": running, "kv_cache_usage": 0.0}


def router():
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # no Ray: only the shim's own state
    r.settings = RoutingSettings()
    r.state = RouterState(r.settings)
    r.metrics = Metrics()
    r._observed, r._candidates, r._live = {}, None, {}
    return r


def test_requests_read_no_digest_until_ray_hands_over_a_new_replica_list():
    r = router()
    candidates = [FakeReplica(f"r{i}", digest(1.0, running=i)) for i in range(20)]
    for _ in range(5):
        ranks = list(asyncio.run(r.choose_replicas(candidates, None)))
        assert sorted(rank[0].replica_id.unique_id for rank in ranks) == sorted(
            c.replica_id.unique_id for c in candidates)
    assert all(c.reads == 1 for c in candidates)  # once, not once per request
    assert r.state.loads._reported["r3"] == 3
    candidates[0].stats = digest(2.0, running=7)  # Ray replaces a replica's stats, and the list
    again = list(candidates)
    asyncio.run(r.choose_replicas(again, None))
    assert r.state.loads._reported["r0"] == 7
    r.state.observe = lambda *a: (_ for _ in ()).throw(AssertionError("observed an unchanged digest"))
    asyncio.run(r.choose_replicas(list(again[1:]), None))  # r0 is gone: retained away, none re-read
    assert "r0" not in r.state.loads._reported


def test_the_simulated_shim_observes_changed_digests_and_keeps_full_replicas():
    class Clock:
        now = 5.0

        def __call__(self):
            return self.now

    live = ("a", "b")
    shim = PagedServeRouter(Clock(), seed=0, routable=lambda: live)
    first = {"a": digest(1.0, running=2), "b": digest(1.0)}
    shim.update_replicas(first)
    seen = []
    real = shim.state.observe
    shim.state.observe = lambda r, d: seen.append(r) or real(r, d)
    shim.update_replicas({**first, "b": digest(2.0, running=1)})
    assert seen == ["b"]
    request = Request("q", 0.0, 16, 2, [11, 12, 13, 14])
    assert next(iter(shim.choose(request, ["b"]))) == "b"  # a retry offered only b
    assert shim.state.loads._reported["a"] == 2  # a is full, not gone: still known
