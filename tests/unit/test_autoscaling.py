from types import SimpleNamespace

import pytest

from pagedserve.serve_app.autoscaling import (KV_WORKING_SET_METRIC, LOAD_METRIC, POLICY_PATH,
                                   QUEUE_DEPTH_METRIC, STEP_DOWN, QueueDepthPolicy,
                                   autoscaling_config, desired_num_replicas, load_trend, policy)


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
    assert desired_num_replicas(0, 2, target_queue_depth=4) == 1  # one step: see below


def test_policy_sums_replica_depth_and_handle_queue_within_bounds():
    n, state = policy(ctx({"a": 3.0}, queued=6.0), target_queue_depth=4)
    assert n == 3 and state["queue_depth"] == 9.0
    n, _ = policy(ctx({"a": 30.0}, hi=2), target_queue_depth=4)
    assert n == 2
    n, _ = policy(ctx({"a": 0.0, "b": 0.0}, lo=1), target_queue_depth=4)
    assert n == 1
    n, _ = policy(ctx({"a": 0.0}, lo=0), target_queue_depth=4)
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


def loaded(depths, load, **kw):
    c = ctx(depths, **kw)
    c.aggregated_metrics[LOAD_METRIC] = dict(load)
    return c


def test_a_fleet_with_full_replicas_and_empty_queues_does_not_scale_down():
    full = {r: 1.0 for r in "abcd"}
    n, state = policy(loaded({r: 0.0 for r in "abcd"}, full, hi=8), target_queue_depth=4)
    assert n == 5 and state["load"] == 4.0  # full is past the 0.8 target: one more
    # without the load the same queues ask for fewer: the oscillation
    assert policy(ctx({r: 0.0 for r in "abcd"}), target_queue_depth=4)[0] == 2
    # replicas at 0.6 keep their count: 3 would run at 0.8, past the 0.8 x 0.9 headroom
    n, _ = policy(loaded({r: 0.0 for r in "abcd"}, {r: 0.6 for r in "abcd"}), target_queue_depth=4)
    assert n == 4
    # at 0.4 they pack onto 3 (1.6 / 0.72 -> 2.2 -> 3)
    n, _ = policy(loaded({r: 0.0 for r in "abcd"}, {r: 0.4 for r in "abcd"}),
                  target_queue_depth=4)
    assert n == 3
    assert desired_num_replicas(0.0, 5, 4, 0.8, total_load=4.0) == 5  # 4 / 0.8 is 5, not 6
    assert desired_num_replicas(9.0, 2, 4, 0.8, total_load=0.0) == 3  # the queue still scales up


def test_replicas_report_their_load_whichever_binds_first():
    from pagedserve.replicas.core.cache_digest import autoscaling_stats

    stats = {"num_waiting": 0, "num_running": 6, "kv_cache_usage": 0.2, "max_num_seqs": 8}
    assert autoscaling_stats(stats) == {QUEUE_DEPTH_METRIC: 0.0, LOAD_METRIC: 0.75}
    stats.update(num_running=2, kv_cache_usage=0.9, compute_utilization=0.5, kv_working_set=1.5)
    assert autoscaling_stats(stats) == {QUEUE_DEPTH_METRIC: 0.0, LOAD_METRIC: 0.9,
                                        KV_WORKING_SET_METRIC: 1.5}
    stats.update(kv_cache_usage=0.1, compute_utilization=0.95)
    del stats["kv_working_set"]
    assert autoscaling_stats(stats)[LOAD_METRIC] == 0.95


def test_a_burst_scales_up_in_bounded_steps():
    # 1,000 queued at 2 replicas is a backlog, not a need for 250 replicas
    assert desired_num_replicas(1000, 2, target_queue_depth=4) == 6  # 2 + 4
    assert desired_num_replicas(1000, 20, target_queue_depth=4) == 30  # 1.5 x 20
    assert desired_num_replicas(30, 20, target_queue_depth=1) == 30  # what it asks, if less


def test_scaling_down_goes_a_step_at_a_time():
    n = 12
    assert desired_num_replicas(0, n, target_queue_depth=4) == n - n // STEP_DOWN
    assert desired_num_replicas(0, 1, target_queue_depth=4) == 0  # min_replicas bounds it after


def test_load_scales_up_before_a_queue_forms():
    assert desired_num_replicas(0, 4, target_queue_depth=4, total_load=3.6, target_load=0.8) == 5
    assert desired_num_replicas(0, 4, target_queue_depth=4, total_load=3.2, target_load=0.8) == 4


def test_the_working_set_holds_the_fleet_up():
    # tenants' contexts worth 2.5 replicas of KV cache: 3 replicas would be 83 % full of it,
    # past the 2/3 a scale-down may leave; 4 stay
    on = dict(cache_coverage=0.8)  # the default
    assert desired_num_replicas(0, 4, 4, total_working_set=2.5, **on) == 4
    assert desired_num_replicas(0, 4, 4, total_working_set=2.0, **on) == 3  # 2.0 fills 3 to 2/3
    # a fleet whose caches hold less than 80 % of it thrashes (no queue yet): it grows
    assert desired_num_replicas(0, 1, 4, total_working_set=2.5, **on) == 2
    assert desired_num_replicas(0, 2, 4, total_working_set=2.5, **on) == 2
    # off: no floor
    assert desired_num_replicas(0, 4, 4, total_working_set=2.5, cache_coverage=0) == 2
    assert desired_num_replicas(0, 2, 4, total_working_set=2.5, cache_coverage=1.0) == 3


def test_load_trend_is_the_least_squares_slope():
    assert load_trend([(0, 1.0), (10, 2.0), (20, 3.0)]) == 0.1
    assert load_trend([(0, 1.0), (10, 2.0)]) == 0.0  # too few points to call a trend
    assert load_trend([(5, 1.0), (5, 2.0), (5, 3.0)]) == 0.0


def timed(load, now, state, n=4):
    c = loaded({r: 0.0 for r in "abcdefgh"[:n]}, {r: load / n for r in "abcdefgh"[:n]},
                 state=state, hi=100)
    c.current_time = now
    return c


def test_a_rising_load_is_planned_for_ahead_and_a_falling_one_is_not():
    state, num = {}, []
    for t in range(0, 61, 5):  # 2.0 -> 3.2 replicas' worth over a minute: 0.02 per s
        n, state = policy(timed(2.0 + 0.02 * t, t, state), target_load=0.8, lead_s=40)
        num.append(n)
    # now 3.2 / 0.8 = 4 replicas; in 40 s 4.0 / 0.8 = 5
    assert state["planned_load"] == pytest.approx(4.0) and num[-1] == 5
    assert num[0] == 3  # the first points are no trend: 2.0 packs onto 3 (2.0 / 0.72 -> 3)
    state = {}
    for t in range(0, 61, 5):
        n, state = policy(timed(3.2 - 0.02 * t, t, state), target_load=0.8, lead_s=40)
    # now's load, not less: 2.0 / 0.72 -> 3 (the trend's 1.2 would pack onto 2)
    assert state["planned_load"] == pytest.approx(2.0) and n == 3
    state = {}
    for t in range(0, 61, 5):  # up for 40 s, then down: the whole window still fits a rise
        n, state = policy(timed(2.0 + 0.04 * min(t, 40) - 0.04 * max(0, t - 40), t, state),
                          target_load=0.8, lead_s=40)
    assert load_trend(state["load_history"]) > 0
    assert state["planned_load"] == pytest.approx(2.8)  # now's: the trend has turned
    state = {}
    for t in range(0, 61, 5):  # up for 55 s, then a drop: the latter half still rises
        n, state = policy(timed(2.0 + 0.04 * t if t < 60 else 2.0, t, state),
                          target_load=0.8, lead_s=40)
    assert load_trend(state["load_history"][-7:-1]) > 0
    assert state["planned_load"] == pytest.approx(2.0)
    # a policy without a clock (an older Ray) follows the load as it is
    c = timed(3.2, 0, {})
    del c.current_time
    assert policy(c, target_load=0.8)[1]["planned_load"] == 3.2


def test_a_surge_right_after_a_scale_down_scales_back_no_further():
    """The queue that follows a scale-down from 6 to 4 (the 4 re-prefill the removed replicas'
    prefixes) asks for 6 again, not for the bounded step a burst would get, while rewarm_s lasts."""
    def surge(now, state=None):  # 80 queued on 4 replicas: 20 replicas' worth at target 4
        c = loaded({r: 20.0 for r in "abcd"}, {r: 0.9 for r in "abcd"}, state=state, hi=100)
        c.current_time = now
        return c

    state = policy(timed(3.0, 0, {}, n=6), rewarm_s=60)[1]
    assert state["num_replicas"] == 6
    n, state = policy(surge(10, state), rewarm_s=60)
    assert n == 6 and state["scaled_down"] == (10, 6)
    # past rewarm_s, or with the cap off, the queue takes its bounded step (4 more: 8)
    assert policy(surge(71, dict(state)), rewarm_s=60)[0] == 8
    assert policy(surge(10, dict(state)), rewarm_s=0)[0] == 8
    # two replicas stopping a tick apart are one scale-down: still back to 6
    state = policy(timed(3.0, 0, {}, n=6), rewarm_s=60)[1]
    state = policy(timed(3.0, 5, state, n=5), rewarm_s=60)[1]
    assert policy(surge(10, state), rewarm_s=60)[0] == 6


def test_a_new_replicas_warming_queue_is_not_demand():
    """A replica that just joined re-prefills the tenants' contexts the router moves onto it: its
    queue is left out of the queue rule for warmup_s. The replicas' own queues still count, and
    those running at the first call (a restarted controller) are warm."""
    def fleet(now, depths, state, **settings):
        c = loaded(depths, {r: 0.7 for r in depths}, state=state, hi=100)
        c.current_time = now
        return policy(c, **settings)

    warm = {r: 1.0 for r in "abcd"}
    n, state = fleet(0, warm, {})
    assert n == 4
    joined = {**warm, "e": 40.0}  # 44 queued on 5: 11 replicas' worth, a bounded step to 9
    n, after = fleet(10, joined, state)
    assert n == 5 and after["queue_depth"] == 4.0 and after["serving_since"]["e"] == 10
    assert fleet(10, joined, state, warmup_s=0)[0] == 9
    assert fleet(40, joined, after)[0] == 9  # warm now: a queue is demand again
    assert fleet(10, {**{r: 10.0 for r in "abcd"}, "e": 40.0}, state)[0] == 9  # 40 on the rest
    assert fleet(0, {r: 10.0 for r in "abcd"}, {})[0] == 8  # 40 at the first call: 4 + 4
    # a deployment's first replicas, seen running after a call that found none: demand too
    none = loaded({}, {}, state={}, hi=100)
    none.current_time = 0
    assert fleet(5, {r: 10.0 for r in "abcd"}, policy(none)[1])[0] == 8
