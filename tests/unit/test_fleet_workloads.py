"""bench.fleet.workloads: the shapes of the four request streams."""
import pytest

from bench.fleet.workloads import Workload, WorkloadSettings


def settings(**kw):
    base = dict(rate=200.0, duration_s=10.0, block_size=16, num_tenants=4, users_per_tenant=5)
    return WorkloadSettings(**{**base, **kw})


def test_llmd_tenants_share_their_context_and_queries_are_unique():
    reqs = list(Workload("llmd", settings(), seed=1).requests())
    context_blocks = 6000 // 16
    contexts = {tuple(r.block_hashes[:context_blocks]) for r in reqs}
    assert len(contexts) == 4
    tails = [h for r in reqs for h in r.block_hashes[context_blocks:]]
    assert len(tails) == len(set(tails))
    assert all(r.num_prompt_tokens == 7200 and r.max_tokens == 128 for r in reqs)
    assert all(len(r.block_hashes) == (7200 + 128) // 16 for r in reqs)


def test_the_ramp_rises_in_equal_steps_and_arrivals_follow_it():
    w = Workload("llmd", settings(num_stages=5), seed=2)
    assert w.stage_rates() == [40.0, 80.0, 120.0, 160.0, 200.0]
    reqs = list(w.requests())
    per_stage = [sum(1 for r in reqs if r.stage == s) for s in range(5)]
    for count, rate in zip(per_stage, w.stage_rates()):
        assert count == pytest.approx(rate * 2.0, rel=0.25)  # 2 s per stage
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def test_chat_turns_extend_the_previous_turn():
    w = Workload("chat", settings(rate=20.0, duration_s=60.0, chat_think_s=1.0), seed=3)
    reqs = list(w.requests())
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.block_hashes[0], []).append(r)
    assert any(len(turns) > 2 for turns in by_session.values())
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.num_prompt_tokens == prev.num_prompt_tokens + 128 + 200
            assert nxt.block_hashes[:len(prev.block_hashes)] == prev.block_hashes
            assert nxt.arrival_s >= prev.arrival_s


def test_nosharing_shares_nothing_and_diurnal_peaks_mid_run():
    reqs = list(Workload("nosharing", settings(), seed=4).requests())
    hashes = [h for r in reqs for h in r.block_hashes]
    assert len(hashes) == len(set(hashes))
    d = Workload("diurnal", settings(duration_s=100.0), seed=5)
    assert d.rate_at(50.0) == pytest.approx(200.0)
    assert d.rate_at(0.0) == pytest.approx(20.0)
    assert d.stage_rates() == [200.0]


def test_same_seed_same_stream():
    a = [(r.arrival_s, r.block_hashes) for r in Workload("chat", settings(), seed=7).requests()]
    b = [(r.arrival_s, r.block_hashes) for r in Workload("chat", settings(), seed=7).requests()]
    assert a == b
