import random
from collections import Counter

import pytest

from pagedserve.replicas.core.block_hash import block_hashes
from pagedserve.serve_app.routing.policy import (
    AFFINITY, COLD_HOME, FALLBACK, LOAD_OVERRIDE, RoutingSettings, rank_replicas, rendezvous_home,
    rendezvous_weight,
)
from pagedserve.serve_app.routing.prefix_index import PrefixMatch
from pagedserve.serve_app.routing.rendezvous import ReplicaSet

BS = 4
IDS = ["r1", "r2", "r3"]
A = block_hashes(list(range(16)), BS)  # a 4-block prompt
SETTINGS = RoutingSettings(load_override_threshold=4, cold_home_max_excess_load=2)


def choose(hashes, loads, matches, settings=SETTINGS, seed=0, queued=None):
    """The decision over the live replicas `loads`, each holding `matches` leading blocks."""
    common = min((matches.get(r, 0) for r in loads), default=0)
    deeper = {r: m for r, m in matches.items() if r in loads and m > common}
    return rank_replicas(hashes, ReplicaSet(loads, loads), PrefixMatch(common, deeper), settings,
                         random.Random(seed), queued)


def idle(ids=IDS):
    return {r: 0.0 for r in ids}


def test_longest_cached_prefix_wins():
    d = choose(A, idle(), {"r1": 1, "r2": 3, "r3": 0})
    assert (d.replica_id, d.reason, d.num_matched_blocks) == ("r2", AFFINITY, 3)
    assert d.ranked == ["r2", "r1", "r3"]


def test_affinity_holds_up_to_the_load_threshold_then_load_wins():
    matches = {"r1": 4, "r2": 0, "r3": 2}
    d = choose(A, {"r1": 6, "r2": 2, "r3": 5}, matches)  # 6 - 2 <= 4: still affinity
    assert (d.replica_id, d.reason) == ("r1", AFFINITY)
    d = choose(A, {"r1": 7, "r2": 2, "r3": 5}, matches)  # 7 - 2 > 4
    assert (d.replica_id, d.reason, d.num_matched_blocks) == ("r3", LOAD_OVERRIDE, 2)
    d = choose(A, {"r1": 7, "r2": 2, "r3": 7}, matches)  # only r2 is within the threshold
    assert (d.replica_id, d.reason, d.num_matched_blocks) == ("r2", LOAD_OVERRIDE, 0)


def test_equal_holders_go_to_the_lower_load_then_to_the_rendezvous_winner():
    matches = {"r1": 4, "r2": 4, "r3": 0}
    assert choose(A, {"r1": 3, "r2": 1, "r3": 0}, matches).replica_id == "r2"
    winner = max(["r1", "r2"], key=lambda r: rendezvous_weight(A[0], r))
    d = choose(A, idle(), matches)
    assert (d.replica_id, d.reason) == (winner, AFFINITY)


def test_cold_prefix_goes_to_its_consistent_home():
    home = rendezvous_home(A[0], IDS)
    d = choose(A, idle(), {})
    assert (d.replica_id, d.reason) == (home, COLD_HOME)
    # the same cold prefix from any router, in any order of replicas, agrees
    assert choose(A, {r: 0.0 for r in reversed(IDS)}, {}).replica_id == home
    # and a different continuation of the same first block shares the home
    other = block_hashes(list(range(4)) + [99] * 12, BS)
    assert choose(other, idle(), {}).replica_id == home


def test_cold_prefixes_spread_over_replicas_at_low_load():
    homes = Counter(choose(block_hashes([i] * 8, BS), idle(), {}).replica_id for i in range(60))
    assert set(homes) == set(IDS)
    assert min(homes.values()) >= 10


def test_an_overloaded_cold_home_is_skipped_for_two_choices():
    settings = SETTINGS  # the default: no pair check
    home = rendezvous_home(A[0], ["r1", "r2"])
    other = "r2" if home == "r1" else "r1"
    d = choose(A, {home: 2.0, other: 0.0}, {}, settings)  # 2 - 0 <= 2: still home
    assert (d.replica_id, d.reason) == (home, COLD_HOME)
    d = choose(A, {home: 3.0, other: 0.0}, {}, settings)
    assert (d.replica_id, d.reason) == (other, FALLBACK)  # two replicas: p2c sees both


def test_a_cold_home_busier_than_the_two_choices_pick_yields_to_it():
    ids = [f"r{i}" for i in range(8)]
    home = rendezvous_home(A[0], ids)
    loads = {r: 1.0 for r in ids} | {home: 2.0}  # within the excess guard of 2
    paired = SETTINGS.model_copy(update={"cold_home_pair_slack": 0.0})
    for seed in range(20):  # any pair but (home, home) holds a replica less loaded than home
        d = choose(A, loads, {}, paired, seed=seed)
        assert d.reason == FALLBACK and loads[d.replica_id] == 1.0
    slack = SETTINGS.model_copy(update={"cold_home_pair_slack": 1.0})
    assert {choose(A, loads, {}, slack, seed=s).replica_id for s in range(20)} == {home}
    assert {choose(A, loads, {}, seed=s).replica_id for s in range(20)} == {home}  # the default: blind
    loads[home] = 1.0  # no busier than any pick: home, every time
    assert {choose(A, loads, {}, paired, seed=s).replica_id for s in range(20)} == {home}


def test_without_the_guard_a_cold_home_yields_only_to_a_pick_lighter_by_the_slack():
    """The setting for unique prompts: the home against one replica drawn at random, no guard
    against the least loaded of the fleet (see the settings' comment)."""
    s = RoutingSettings(cold_home_pair_slack=8, cold_home_max_excess_load=None)
    ids = [f"r{i}" for i in range(8)]
    home = rendezvous_home(A[0], ids)
    loads = {r: 0.0 for r in ids} | {home: 8.0}  # far above the least, within the slack of all
    assert {choose(A, loads, {}, s, seed=seed).replica_id for seed in range(20)} == {home}
    loads[home] = 9.0  # every other replica is lighter by more than the slack: it takes it
    for seed in range(20):
        d = choose(A, loads, {}, s, seed=seed)
        assert d.replica_id != home and d.reason == FALLBACK
    loads = {r: 0.0 for r in ids} | {home: 9.0, ids[ids.index(home) - 1]: 9.0}
    picks = {choose(A, loads, {}, s, seed=seed).replica_id for seed in range(40)}
    assert home in picks and len(picks) > 1  # home when the random other is as busy


def test_a_prefix_every_replica_holds_says_nothing_the_rest_is_cold():
    matches = {r: 2 for r in IDS}  # say, a shared chat-template header
    d = choose(A, idle(), matches)
    assert (d.replica_id, d.reason) == (rendezvous_home(A[2], IDS), COLD_HOME)
    assert d.num_matched_blocks == 2


def test_min_affinity_blocks():
    settings = RoutingSettings(min_affinity_blocks=2)
    d = choose(A, idle(), {"r1": 1}, settings)
    assert d.reason == COLD_HOME and d.replica_id == rendezvous_home(A[0], IDS)
    d = choose(A, idle(), {"r1": 2}, settings)
    assert (d.replica_id, d.reason) == ("r1", AFFINITY)


def test_cold_home_blocks_names_the_home_further_in():
    settings = RoutingSettings(cold_home_blocks=3)
    assert choose(A, idle(), {}, settings).replica_id == rendezvous_home(A[2], IDS)
    short = A[:2]  # fewer blocks than cold_home_blocks: the last one names the home
    assert choose(short, idle(), {}, settings).replica_id == rendezvous_home(A[1], IDS)


def test_no_full_block_falls_back_to_two_choices_on_load():
    loads = {"r1": 5.0, "r2": 1.0, "r3": 3.0}
    picks = {choose([], loads, {}, seed=s).replica_id for s in range(20)}
    assert "r1" not in picks  # the most loaded never wins a pair
    assert picks == {"r2", "r3"}
    assert choose([], loads, {}).reason == FALLBACK


def test_two_choices_go_to_the_fewer_prompt_blocks_queued_for_prefill_before_load():
    loads = {"r1": 1.0, "r2": 9.0, "r3": 9.0}  # r1: few requests, but a long prompt in prefill
    queued = {"r1": 120, "r2": 0}  # r3 unknown: none
    picks = Counter(choose([], loads, {}, seed=s, queued=queued).replica_id for s in range(30))
    assert "r1" not in picks and set(picks) == {"r2", "r3"}
    even = {"r1": 4, "r2": 4, "r3": 4}  # the same queue: load decides
    assert {choose([], loads, {}, seed=s, queued=even).replica_id
            for s in range(30)} == {choose([], loads, {}, seed=s).replica_id for s in range(30)}


def test_single_replica_and_validation():
    d = choose(A, {"r1": 9.0}, {})
    assert d.ranked == ["r1"]
    with pytest.raises(ValueError):
        choose(A, {}, {})
    with pytest.raises(ValueError):
        RoutingSettings(load_override_threshold=-1)
    with pytest.raises(ValueError):
        RoutingSettings(unknown=1)


def test_rendezvous_weight_is_stable_across_processes():
    import subprocess
    import sys
    code = "from pagedserve.serve_app.routing.policy import rendezvous_weight as w; print(w(-12345, 'abc'))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={"PYTHONHASHSEED": "7", "PATH": ""}).stdout
    assert int(out) == rendezvous_weight(-12345, "abc")


def test_the_ranking_past_the_first_choice_is_made_only_when_asked_for(monkeypatch):
    import pagedserve.serve_app.routing.policy as policy
    ids = [f"r{i}" for i in range(50)]
    d = choose(A, {r: 0.0 for r in ids}, {"r7": 4})
    asked = []
    real = d.rest
    d.rest = lambda: asked.append(1) or real()
    ranking = d.ranking()
    assert next(ranking) == "r7" and not asked  # Ray took the first: nothing else was sorted
    assert next(ranking) != "r7" and asked == [1]
    assert sorted(d.ranked) == sorted(ids) and asked == [1]  # sorted once
    monkeypatch.setattr(policy, "_rank_rest", lambda *a: pytest.fail("ranked the rest"))
    assert choose(A, {r: 0.0 for r in ids}, {}).replica_id == rendezvous_home(A[0], ids)


def test_defaults_leave_room_for_a_hot_prefix_before_load_wins():
    # A replica batches many requests: 4 or 2 more than the least-loaded one spilled hot prefixes
    # long before their holder was busy (see the settings' comment for bench.fleet's figures).
    s = RoutingSettings()
    assert (s.load_override_threshold, s.cold_home_max_excess_load) == (16, 8)
    assert s.cold_home_pair_slack is None
    d = choose(A, {"r1": 15.0, "r2": 0.0, "r3": 0.0}, {"r1": 4}, settings=s)
    assert (d.replica_id, d.reason) == ("r1", AFFINITY)
    d = choose(A, {"r1": 17.0, "r2": 0.0, "r3": 0.0}, {"r1": 4}, settings=s)
    assert d.reason == LOAD_OVERRIDE


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_holders,busy", [(5, False), (40, False), (5, True)])
def test_ties_among_many_replicas_go_to_the_rendezvous_winner(seed, num_holders, busy):
    """Past a few tied replicas (holders, or the least loaded) the weights are compared in numpy:
    the same winner as weighing each replica on its own."""
    rng = random.Random(seed)
    ids = [f"replica-{i:03d}" for i in range(60)]
    loads = {r: float(rng.choice([0, 0, 1])) for r in ids}
    holders = rng.sample(ids, num_holders)
    for r in holders:
        loads[r] = 9.0 if busy else float(rng.choice([0, 0, 1]))
    settings = RoutingSettings(load_override_threshold=4)
    if not busy:  # equal matches: the lowest load among them, then the weight
        lowest = min(loads[r] for r in holders)
        tied, reason = [r for r in holders if loads[r] == lowest], AFFINITY
    else:  # every holder is too busy: the least-loaded replicas (none of them a holder)
        tied, reason = [r for r in ids if loads[r] == 0.0], LOAD_OVERRIDE
    assert len(tied) > 1
    winner = max(tied, key=lambda r: rendezvous_weight(A[0], r))
    d = choose(A, loads, {r: 4 for r in holders}, settings)
    assert (d.replica_id, d.reason) == (winner, reason)
