"""bench.fleet.autoscaler: Ray's window averaging of every reported metric around the policy."""
from bench.fleet.autoscaler import Autoscaler, AutoscalerSettings


def run(stats, seconds=30.0, replicas=("a", "b", "c", "d")):
    scaler = Autoscaler(AutoscalerSettings(min_replicas=1, downscale_delay_s=5.0))
    target = len(replicas)
    t = 0.0
    while t < seconds:
        for r in replicas:
            scaler.push(r, stats, t)
        target = scaler.decide(t, list(replicas), target, queued=0)
        t += 0.5
    return target, scaler


def test_a_full_fleet_with_empty_queues_keeps_its_replicas():
    target, scaler = run({"queue_depth": 0.0, "batch_occupancy": 1.0})
    assert target == 4
    assert scaler.policy_state["batch_occupancy"] == 4.0


def test_an_idle_fleet_scales_down_after_the_delay():
    target, _ = run({"queue_depth": 0.0, "batch_occupancy": 0.0})
    assert target == 1
