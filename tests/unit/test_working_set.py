from pagedserve.replicas.core.working_set import WorkingSet


def test_blocks_looked_up_once_are_not_a_working_set():
    ws = WorkingSet(window_s=10)
    for first in range(0, 1000, 10):  # unique prompts: nothing to gain from caching them
        ws.touch(range(first, first + 10))
    assert ws.measure(0.0) == 0


def test_reuse_counts_each_block_once():
    ws = WorkingSet(window_s=10)
    for _ in range(5):
        ws.touch(range(100))  # one context, five requests
    ws.touch(range(100, 150))  # a query: once
    assert ws.measure(0.0) == 100


def test_reuse_across_a_generation_turn_counts():
    ws = WorkingSet(window_s=10)
    ws.measure(0.0)
    ws.touch(range(50))
    assert ws.measure(5.0) == 0  # the turn: that lookup is now the previous generation
    ws.touch(range(40, 60))
    assert ws.measure(6.0) == 10  # 40..49 looked up in both generations


def test_reuse_ages_out():
    ws = WorkingSet(window_s=10)
    ws.measure(0.0)
    ws.touch(range(50))
    ws.touch(range(50))
    assert ws.measure(1.0) == 50
    assert ws.measure(5.0) == 50  # the previous generation still counts
    assert ws.measure(10.0) == 0
    ws.touch(range(50))  # a lookup after the window: no longer a reuse
    assert ws.measure(11.0) == 0


def test_a_long_silence_clears_both_generations():
    ws = WorkingSet(window_s=10)
    ws.measure(0.0)
    ws.touch(range(50))
    ws.touch(range(50))
    assert ws.measure(30.0) == 0
    ws.touch(range(50))
    assert ws.measure(31.0) == 0
