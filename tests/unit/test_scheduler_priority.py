"""scheduling_policy="priority": admission by (priority, arrival), preemption of the least urgent;
fcfs unchanged."""
import pytest

from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.scheduler import Scheduler
from pagedserve.replicas.core.sequence import Sequence

BS = 4


def make(policy, num_blocks=64, max_seqs=8, budget=64):
    return Scheduler(BlockManager(num_blocks, BS), max_seqs, budget, 256, True, policy)


def seq(n_prompt, priority=0, arrival=0.0, max_tokens=4, start=0):
    return Sequence("r", list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                    BS, arrival_time=arrival, priority=priority)


def admitted(sched):
    return [s.seq for s in sched.schedule().scheduled]


def test_priority_admits_lowest_value_first_then_by_arrival():
    sched = make("priority", max_seqs=1)
    late_urgent, early_normal, early_urgent = seq(3, 0, 2.0), seq(3, 1, 0.0), seq(3, 0, 1.0)
    for s in (early_normal, late_urgent, early_urgent):
        sched.add(s)
    assert list(sched.waiting) == [early_urgent, late_urgent, early_normal]
    assert admitted(sched) == [early_urgent]


def test_fcfs_ignores_priority_order():
    sched = make("fcfs", max_seqs=1)
    a, b = seq(3, 5, 0.0), seq(3, 0, 1.0)
    sched.add(a), sched.add(b)
    assert admitted(sched) == [a]


def test_priority_preempts_the_least_urgent_running_sequence():
    # 3 sequences of 4 prompt tokens fill 3 of 3 blocks; the next token of the first needs a 4th.
    sched = make("priority", num_blocks=3)
    urgent, normal, background = seq(4, 0, 2.0), seq(4, 1, 0.0, start=10), seq(4, 2, 1.0, start=20)
    for s in (normal, background, urgent):
        sched.add(s)
    first = sched.schedule()
    sched.update(first, [[7]] * len(first.scheduled))
    out = sched.schedule()  # each needs a second block: only one can have it
    assert out.preempted == [background, normal]  # least urgent first, whatever the arrival
    assert [s.seq for s in out.scheduled] == [urgent]
    assert list(sched.waiting) == [normal, background]
    assert background.num_computed_tokens == 0
    # fcfs preempts the youngest first: the urgent one.
    fcfs = make("fcfs", num_blocks=3)
    u2, n2, b2 = seq(4, 0, 2.0), seq(4, 1, 0.0, start=10), seq(4, 2, 1.0, start=20)
    for s in (n2, b2, u2):
        fcfs.add(s)
    first = fcfs.schedule()
    fcfs.update(first, [[7]] * len(first.scheduled))
    out = fcfs.schedule()
    assert out.preempted == [u2, b2] and [s.seq for s in out.scheduled] == [n2]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        make("lifo")
