import pytest

from pagedserve.replicas.core.step_load import StepLoad


def test_a_light_load_reads_low_though_the_engine_is_always_stepping():
    load = StepLoad(window_s=10)
    t = 0.0
    while t < 10:  # back-to-back steps, busy all the time: a few 5 ms one-token steps ...
        for _ in range(3):
            t += 0.005
            load.record(t, 0.005, num_tokens=1)
        t += 0.0065  # ... and one of 4 tokens
        load.record(t, 0.0065, num_tokens=4)
    assert load.utilization(t) == pytest.approx(0.07, abs=0.01)  # 1.5 of 21.5 ms is work


def test_the_work_beyond_the_fixed_part_is_the_load():
    load = StepLoad(window_s=10)
    load.record(0.0, 0.005, num_tokens=1)
    for i in range(1, 101):  # 100 steps of 55 ms in 5.5 s: 5 s of work beyond the fixed part
        load.record(i * 0.055, 0.055, num_tokens=64)
    assert load.utilization(5.5) == pytest.approx(0.5, abs=0.01)


def test_the_fixed_part_is_the_light_steps_mean_not_the_fastest():
    load = StepLoad(window_s=1)
    for i in range(200):  # jittery one-token steps, 1 to 3 ms: no load at all
        load.record(i * 0.002, 0.001 + 0.002 * (i % 2), num_tokens=1)
    assert load.fastest_s == 0.001 and load.fixed_s == pytest.approx(0.002, abs=0.0002)
    assert load.utilization(0.4) < 0.1


def test_a_saturated_window_keeps_the_fixed_part_from_before():
    load = StepLoad(window_s=1)
    load.record(0.0, 0.005, num_tokens=1)
    for i in range(1, 40):  # long after: only big steps in the window
        load.record(10 + i * 0.1, 0.1, num_tokens=256)
    assert load.utilization(13.95) == pytest.approx(0.95, abs=0.01)  # 13.0 .. 13.9 in it


def test_before_a_light_step_the_fastest_stands_in():
    load = StepLoad(window_s=1)
    load.record(0.5, 0.02, num_tokens=100)
    load.record(0.9, 0.1, num_tokens=900)
    assert load.fixed_s == 0.02 and load.utilization(1.0) == pytest.approx(0.08)


def test_it_fades_to_zero_once_idle_and_stays_within_bounds():
    load = StepLoad(window_s=1)
    load.record(0.0, 0.001, num_tokens=1)
    load.record(0.5, 2.0, num_tokens=8000)  # one long step: capped at 1
    assert load.utilization(0.5) == 1.0
    assert load.utilization(1.6) == 0.0
    assert load.busy_s == 0.0
