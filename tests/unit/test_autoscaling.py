from types import SimpleNamespace

import pytest

from serve_app.autoscaling import (BATCH_OCCUPANCY_METRIC, POLICY_PATH, QUEUE_DEPTH_METRIC,
                                   QueueDepthPolicy, autoscaling_config, desired_num_replicas,
                                   policy)


def ctx(depths, *, queued=0.0, current=None, lo=1, hi=4, state=None):
    replicas = list(depths)
    return SimpleNamespace(
        aggregated_metrics={QUEUE_DEPTH_METRIC: dict(depths)}, running_replicas=replicas,
        total_queued_requests=queued, current_num_replicas=len(replicas) if current is None else current,
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=state or {})


def test_desired_replicas_up_at_the_target_down_with_headroom():
    assert desired_num_replicas(4.0, 1, target_queue_depth=4) == 1
    assert desired_num_replicas(4.1, 1, target_queue_depth=4) == 2
    assert desired_num_replicas(13, 2, target_queue_depth=4) == 4
    # two replicas, total 3.5: one would hold 3.5 > 0.8 * 4, so keep two; at 3.2 give one back
    assert desired_num_replicas(3.5, 2, target_queue_depth=4, downscale_ratio=0.8) == 2
    assert desired_num_replicas(3.2, 2, target_queue_depth=4, downscale_ratio=0.8) == 1
    assert desired_num_replicas(0, 3, target_queue_depth=4) == 0


def test_policy_sums_replica_depth_and_handle_queue_within_bounds():
    n, state = policy(ctx({"a": 3.0}, queued=6.0), target_queue_depth=4)
    assert n == 3 and state["queue_depth"] == 9.0
    n, _ = policy(ctx({"a": 30.0}, hi=2), target_queue_depth=4)
    assert n == 2
    n, _ = policy(ctx({"a": 0.0, "b": 0.0}, lo=1), target_queue_depth=4)
    assert n == 1
    n, _ = policy(ctx({"a": 0.0, "b": 0.0}, lo=0), target_queue_depth=4)
    assert n == 0


def test_policy_ignores_replicas_not_running_and_keeps_custom_state():
    c = ctx({"a": 2.0}, state={"mine": 1})
    c.aggregated_metrics[QUEUE_DEPTH_METRIC]["gone"] = 100.0
    n, state = policy(c, target_queue_depth=4)
    assert n == 1 and state["mine"] == 1


def test_policy_without_metrics_yet():
    c = ctx({"a": 0.0})
    c.aggregated_metrics = {}
    c.total_queued_requests = None
    assert policy(c)[0] == 1


def test_class_policy_binds_its_settings():
    p = QueueDepthPolicy(target_queue_depth=1.0)
    assert p(ctx({"a": 2.5}))[0] == 3
    with pytest.raises(ValueError):
        QueueDepthPolicy(target_queue_depth=0)


def test_autoscaling_config_is_valid_for_ray_serve():
    from ray.serve.config import AutoscalingConfig

    config = autoscaling_config(min_replicas=1, max_replicas=2, target_queue_depth=2,
                                upscale_delay_s=3, downscale_delay_s=5, look_back_period_s=0.5,
                                metrics_interval_s=0.5)
    parsed = AutoscalingConfig(**config)
    assert parsed.policy.policy_function == POLICY_PATH
    assert parsed.policy.policy_kwargs["target_queue_depth"] == 2
    assert parsed.look_back_period_s > parsed.metrics_interval_s
    assert (parsed.upscale_delay_s, parsed.downscale_delay_s) == (3, 5)
    instance = parsed.policy.get_policy()(**parsed.policy.policy_kwargs)
    assert instance(ctx({"a": 5.0}))[0] == 3


def occupied(depths, occupancy, **kw):
    c = ctx(depths, **kw)
    c.aggregated_metrics[BATCH_OCCUPANCY_METRIC] = dict(occupancy)
    return c


def test_a_fleet_with_full_batches_and_empty_queues_does_not_scale_down():
    full = {r: 1.0 for r in "abcd"}
    n, state = policy(occupied({r: 0.0 for r in "abcd"}, full), target_queue_depth=4)
    assert n == 4 and state["batch_occupancy"] == 4.0
    # without the occupancy the same queues ask for the minimum: the oscillation
    assert policy(ctx({r: 0.0 for r in "abcd"}), target_queue_depth=4)[0] == 1
    # half-full batches pack onto the replicas that can hold them at most 80% full
    n, _ = policy(occupied({r: 0.0 for r in "abcd"}, {r: 0.5 for r in "abcd"}), target_queue_depth=4)
    assert n == 3  # 2 replicas' worth of batches / 0.8 -> 2.5 -> 3
    assert desired_num_replicas(0.0, 5, 4, 0.8, total_occupancy=4.0) == 5  # 4 / 0.8 is 5, not 6
    assert desired_num_replicas(9.0, 2, 4, 0.8, total_occupancy=0.0) == 3  # the queue still scales up


def test_replicas_report_their_batch_occupancy():
    from replicas.cache_digest import autoscaling_stats

    class Engine:
        scheduler = type("S", (), {"max_num_seqs": 8})()

    class AsyncEngine:
        engine = Engine()

        def stats(self):
            return {"num_waiting": 0, "num_running": 6, "kv_cache_usage": 0.2}

    assert autoscaling_stats(AsyncEngine()) == {QUEUE_DEPTH_METRIC: 0.0, BATCH_OCCUPANCY_METRIC: 0.75}
