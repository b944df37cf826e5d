"""bench.fleet.autoscaler: Ray's window averaging of every reported metric around the policy."""
from bench.fleet.autoscaler import Autoscaler, AutoscalerSettings


def run(stats, seconds=30.0, replicas=("a", "b", "c", "d")):
    scaler = Autoscaler(AutoscalerSettings(min_replicas=1, downscale_delay_s=5.0))
    target = len(replicas)
    t = 0.0
    while t < seconds:
        running = list(replicas[:target])  # a replica scaled down stops at once here
        for r in running:
            scaler.push(r, stats, t)
        target = scaler.decide(t, running, target, queued=0)
        t += 0.5
    return target, scaler


def test_a_fleet_at_its_target_load_with_empty_queues_keeps_its_replicas():
    target, scaler = run({"queue_depth": 0.0, "load": 0.8})
    assert target == 4
    assert abs(scaler.policy_state["load"] - 3.2) < 1e-9


def test_an_idle_fleet_scales_down_a_step_per_delay():
    target, _ = run({"queue_depth": 0.0, "load": 0.0}, seconds=5.5)
    assert target == 2  # half
    target, _ = run({"queue_depth": 0.0, "load": 0.0})
    assert target == 1
