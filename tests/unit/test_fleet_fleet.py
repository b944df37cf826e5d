"""bench.fleet.fleet: routers on a small simulated fleet, the handle's limits, the autoscaler."""
import gc
import weakref

import pytest

from bench.fleet.autoscaler import AutoscalerSettings
from bench.fleet.cost_model import CostModel
from bench.fleet.fleet import Fleet, FleetSettings
from bench.fleet.replica import ReplicaSettings
from bench.fleet.report import summarize
from bench.fleet.workloads import Workload, WorkloadSettings

MODEL = CostModel(step_overhead_s=0.005, prefill_token_s=2e-5, decode_seq_s=2e-4)
REPLICA = ReplicaSettings(num_blocks=700, block_size=16, max_num_seqs=16,
                          max_num_batched_tokens=4096)


def run(router, workload="llmd", rate=20.0, duration_s=20.0, replicas=4, **fleet):
    w = Workload(workload, WorkloadSettings(rate=rate, duration_s=duration_s, num_tenants=12,
                                            context_tokens=2000, query_tokens=200,
                                            output_tokens=16, num_stages=2), seed=0)
    f = Fleet(router, w, MODEL, FleetSettings(num_replicas=replicas, replica=REPLICA, **fleet),
              seed=0)
    return f.run()


def test_every_router_serves_the_same_stream_and_the_prefix_routers_hit_more():
    results = {name: summarize(run(name), wall_s=0.0)
               for name in ("pagedserve", "p2c", "approx", "random", "roundrobin", "oracle")}
    counts = {r["num_requests"] for r in results.values()}
    assert len(counts) == 1  # same seed, same arrivals
    for r in results.values():
        assert r["rejection_rate"] == 0.0 and r["num_first_tokens"] > 0
        assert r["replica_seconds"] == pytest.approx(4 * 20.0)
    assert results["pagedserve"]["hit_rate"] > results["p2c"]["hit_rate"] + 0.2
    assert results["oracle"]["hit_rate"] > results["random"]["hit_rate"] + 0.2


def test_a_run_makes_no_full_collections_and_first_frees_the_last_runs_fleet():
    enabled = gc.isenabled()
    gc.disable()  # no collections but the run's own
    try:
        first = weakref.ref(run("pagedserve", duration_s=5.0))
        assert first() is not None  # a cycle (its replicas call back into it): refcounts keep it
        f = Fleet("p2c", Workload("llmd", WorkloadSettings(rate=5.0, duration_s=2.0), seed=0),
                  MODEL, FleetSettings(num_replicas=2, replica=REPLICA), seed=0)
        during = []
        f.queue.at(1.0, lambda: during.append(gc.get_threshold()))
        before = gc.get_threshold()
        f.run()
        assert first() is None  # freed by the collection the run began with
        assert during[0][:2] == before[:2] and during[0][2] >= 1 << 30  # no full ones in it
        assert gc.get_threshold() == before
    finally:
        if enabled:
            gc.enable()


def test_pagedserve_sees_digests_and_routes_a_tenant_home():
    f = run("pagedserve", duration_s=10.0)
    state = f.router.state
    assert set(state.loads._reported) == set(f.live)  # every replica's digest arrived
    homes = {}
    for replica in f.replicas.values():
        for seq_hash in replica.block_manager.cached:
            homes.setdefault(seq_hash, set()).add(replica.replica_id)
    # a tenant context's first block lives on few replicas, not all of them
    first_blocks = [h for h in homes if len(homes[h]) > 0]
    assert first_blocks and max(len(homes[h]) for h in first_blocks) < len(f.live)


def test_each_ingress_routes_its_share_and_weighs_its_sends_by_it():
    f = run("pagedserve", num_ingresses=2)
    routers = f.router.routers
    sent = [sum(r.state.loads._num_sent.values()) for r in routers]
    assert len(routers) == 2 and min(sent) > 0.3 * sum(sent)  # requests spread over both
    for router in routers:
        assert set(router.state.loads._reported) == set(f.live)  # every digest reached each
        assert 1.5 < router.state.loads.send_weight < 2.5  # about half the arrivals were its own
    r = summarize(f, wall_s=0.0)
    assert r["rejection_rate"] == 0.0 and r["num_first_tokens"] == r["num_requests"]
    one = run("pagedserve")  # one ingress: its sends are all the arrivals
    assert one.router.state.loads.send_weight == 1.0


def test_each_ingress_hears_the_step_reports_of_the_replicas_running_its_requests(monkeypatch):
    """A step's outputs go to the ingresses of their requests, each with the step's report, as
    on the engine cores' output channels: each router hears its own requests finish there and
    reads the replicas' loads as of their last step, not their last digest."""
    from pagedserve.serve_app.routing.router_state import RouterState
    heard = []
    observe_step = RouterState.observe_step

    def spy(self, replica_id, with_output, finished, report):
        heard.append((self, list(finished)))
        observe_step(self, replica_id, with_output, finished, report)

    monkeypatch.setattr(RouterState, "observe_step", spy)
    f = run("pagedserve", num_ingresses=2)
    states = [router.state for router in f.router.routers]
    finished_at = {state: {r for s, ids in heard if s is state for r in ids} for state in states}
    assert all(finished_at.values()) and not set.intersection(*finished_at.values())
    assert len(heard) > 20 * 20 * len(f.live)  # a report with each step, not once a second
    for state in states:  # the last report applied: a step's (digests are taken each second)
        assert any(t % f.settings.stats_period_s for t in state.loads._report_time.values())


def test_a_full_fleet_queues_at_the_handle_then_rejects():
    f = run("p2c", rate=400.0, duration_s=4.0, replicas=1, max_queued_requests=5)
    r = summarize(f, wall_s=0.0)
    assert r["rejection_rate"] > 0.5
    assert max(f.series["handle_queue"]) <= 5
    assert all(n <= f.max_ongoing for n in f.ongoing.values())


def test_the_autoscaler_adds_replicas_after_the_delay_and_start_up():
    scaler = AutoscalerSettings(min_replicas=1, max_replicas=6, upscale_delay_s=2.0,
                                downscale_delay_s=5.0, startup_s=3.0)
    f = run("pagedserve", workload="diurnal", rate=60.0, duration_s=40.0, replicas=1,
            autoscaler=scaler)
    replicas = f.series["replicas"]
    assert replicas[0] == 1 and max(replicas) > 1
    first_up = next(i for i, n in enumerate(replicas) if n > 1)
    assert first_up >= 2  # no sooner than upscale_delay_s
    assert f.replica_seconds < 6 * 40.0
    assert f.autoscaler.policy_state["desired_num_replicas"] >= 1


def test_event_order_a_request_is_routed_before_its_first_token_and_finish():
    f = run("pagedserve", duration_s=5.0)
    o = f.outcome
    assert all(t > 0 for t in o.ttft_s)
    assert len(f.decision_s) >= sum(f.num_arrivals) - sum(f.num_rejected)
