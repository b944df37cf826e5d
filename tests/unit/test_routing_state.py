"""The router's behaviour end to end over fake replicas: digests in, exact choices out."""
import random
from collections import Counter

from pagedserve.replicas.core.block_hash import block_hashes
from pagedserve.replicas.core.cache_digest import DIGEST_VERSION
from pagedserve.replicas.core.kv_events import BlockStored, KVSnapshot, encode_event, wire_stream
from pagedserve.serve_app.routing.policy import (
    AFFINITY, COLD_HOME, FALLBACK, LOAD_OVERRIDE, RoutingSettings, rendezvous_home,
)
from pagedserve.serve_app.routing.router_state import RouterState

BS = 4
SYSTEM = list(range(1000, 1032))  # an 8-block "system prompt"


def prompt(user_turn: int) -> list[int]:
    return SYSTEM + [user_turn] * 6


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def digest(t, hashes=(), waiting=0, running=0, hit_rate=0.0, kv_events=None, arrived=None):
    """A digest; by default its stream is a snapshot saying the replica holds exactly `hashes`."""
    if kv_events is None:
        kv_events = wire_stream(0, [], KVSnapshot(0, list(hashes)))
    return {"version": DIGEST_VERSION, "time": t, "block_size": BS, "kv_events": kv_events,
            "num_waiting": waiting, "num_running": running, "kv_cache_usage": 0.0,
            "num_arrived": arrived, "prefix_cache_hit_rate": hit_rate}


def state(**settings):
    clock = Clock()
    return RouterState(RoutingSettings(**settings), rng=random.Random(0), clock=clock), clock


def test_repeated_cold_prefix_converges_then_spills_when_its_replica_fills():
    s, clock = state(load_override_threshold=4, cold_home_max_excess_load=2)
    live = ["r1", "r2"]
    hashes = [block_hashes(prompt(i), BS) for i in range(8)]
    home = rendezvous_home(hashes[0][0], live)
    other = "r2" if home == "r1" else "r1"
    decisions = []
    for i in range(8):  # a burst, all before the next digest
        d = s.choose(f"q{i}", hashes[i], live)
        decisions.append((d.replica_id, d.reason))
        clock.now += 0.01
    assert decisions[0] == (home, COLD_HOME)
    assert decisions[1:5] == [(home, AFFINITY)] * 4  # load 1..4 vs 0: within the threshold
    assert decisions[5] == (other, LOAD_OVERRIDE)  # 5 - 0 > 4: the hot prefix spills
    # both hold it now: equal holders go by load
    assert [r for r, _ in decisions[6:]] == [other, other]
    assert Counter(r for r, _ in decisions) == {home: 5, other: 3}


def test_distinct_cold_prefixes_spread_and_misses_avoid_the_loaded_replica():
    s, clock = state(cold_home_max_excess_load=2)
    live = ["r1", "r2", "r3"]
    picks = Counter()
    for i in range(30):
        d = s.choose(f"q{i}", block_hashes([i] * 8, BS), live)
        picks[d.replica_id] += 1
        assert d.reason in (COLD_HOME, FALLBACK)
        loads = [s.load(r) for r in live]
        # A burst of misses never drowns one replica: a home takes one more up to 2 above the
        # least (3), and two choices between the two busiest can add one more.
        assert max(loads) - min(loads) <= 4
    assert set(picks) == set(live)


def test_load_counts_sends_since_the_digest_and_forgets_finished_ones():
    s, clock = state()
    live = ["r1", "r2"]
    assert s.observe("r1", digest(100.0, waiting=2, running=1))
    assert not s.observe("r1", digest(100.0, waiting=9))  # not newer: ignored
    assert not s.observe("r2", {})  # no digest yet
    assert not s.observe("r2", {**digest(100.0), "version": DIGEST_VERSION + 1})
    clock.now = 100.5
    d = s.choose("q1", [], live)  # no full block: p2c on load -> r2
    assert (d.replica_id, d.reason) == ("r2", FALLBACK)
    assert (s.load("r1"), s.load("r2")) == (3, 1)
    s.completed("q1")
    assert s.load("r2") == 0


def test_other_ingresses_sends_show_in_the_replicas_arrivals_and_weigh_ours():
    """Two ingress replicas route alike; each sees half the sends. Weighed by its share of the
    replicas' arrivals, each of its sends since a digest counts twice."""
    s, clock = state()
    live = ["r1", "r2"]
    s.observe("r1", digest(99.0, arrived=0))
    s.observe("r2", digest(99.0, arrived=0))
    for i in range(40):  # ours: 40 of the 80 each replica received
        for replica_id in live:
            d = s.choose(None, [], live)
            s.dispatched(f"{replica_id}-{i}", replica_id, [], d)
            s.completed(f"{replica_id}-{i}")
    clock.now = 100.5
    s.observe("r1", digest(100.0, running=3, arrived=80))
    s.observe("r2", digest(100.0, running=3, arrived=80))
    assert s.loads.send_weight == 2.0
    d = s.choose("q", [], live)
    assert (s.load(d.replica_id), s.load(({*live} - {d.replica_id}).pop())) == (3 + 2, 3)


def test_digest_drives_affinity_and_is_replaced_by_the_next():
    s, clock = state()
    live = ["r1", "r2"]
    hashes = block_hashes(prompt(0), BS)
    s.observe("r2", digest(99.0, hashes[:8], hit_rate=0.75))
    s.observe("r1", digest(99.0))
    d = s.choose("q1", hashes, live)
    assert (d.replica_id, d.reason, d.num_matched_blocks) == ("r2", AFFINITY, 8)
    assert s.hit_rates == {"r1": 0.0, "r2": 0.75}
    # r2 evicted it and says so in a digest taken long after our optimistic insert
    s.observe("r2", digest(clock.now + s.settings.optimistic_ttl_s))
    s.observe("r1", digest(clock.now + s.settings.optimistic_ttl_s, hashes[:2]))
    d = s.choose("q2", hashes, live)
    assert (d.replica_id, d.num_matched_blocks) == ("r1", 2)


def test_a_refused_send_moves_the_bookkeeping_down_the_ranking():
    s, clock = state()
    live = ["r1", "r2"]
    hashes = block_hashes(prompt(0), BS)
    s.observe("r1", digest(99.0, hashes))
    d = s.choose(None, hashes, live)
    assert d.ranked == ["r1", "r2"]
    reason, at = s.dispatched("q1", "r1", hashes, d)
    assert reason == AFFINITY and (s.load("r1"), s.load("r2")) == (1, 0)
    clock.now += 0.1
    s.refused("q1", "r1", hashes, at)  # r1 was full: the ingress sends it to the next rank
    assert s.dispatched("q1", "r2", hashes, d)[0] == LOAD_OVERRIDE
    assert (s.load("r1"), s.load("r2")) == (0, 1)
    assert s.index.match(hashes, ["r2"]) == {"r2": len(hashes)}


def test_a_rechoice_of_the_same_request_is_not_counted_twice():
    s, clock = state()
    live = ["r1", "r2"]
    s.choose("q1", [], live)
    s.choose("q1", [], live)
    assert s.load("r1") + s.load("r2") == 1


def test_dead_replicas_are_forgotten():
    s, clock = state()
    hashes = block_hashes(prompt(0), BS)
    s.observe("r1", digest(99.0, hashes))
    s.choose("q1", hashes, ["r1", "r2"])
    s.retain(["r2"])
    d = s.choose("q2", hashes, ["r2"])
    assert d.ranked == ["r2"]
    assert s.hit_rates == {}
    assert s.index.replica_ids == {"r2"}


def test_events_between_snapshots_drive_affinity_and_a_hole_waits_for_the_next_snapshot():
    s, clock = state()
    live = ["r1", "r2"]
    hashes = block_hashes(prompt(0), BS)
    stored = encode_event(0, BlockStored(hashes[:8], None))
    s.observe("r1", digest(99.0))  # both start empty, no events yet
    s.observe("r2", digest(99.0, kv_events=wire_stream(1, [stored], None)))
    d = s.choose("q1", hashes, live)
    assert (d.replica_id, d.reason, d.num_matched_blocks) == ("r2", AFFINITY, 8)
    # r1's report skips events 0..4: a hole. What it says from 5 on is applied, but the index
    # knows it is not exact until a snapshot comes.
    later = encode_event(5, BlockStored(hashes[:2], None))
    s.observe("r1", digest(100.0, kv_events=wire_stream(6, [later], None)))
    assert not s.index.in_sync("r1") and s.index.in_sync("r2")
    assert s.index.match(hashes, ["r1"]) == {"r1": 2}
    s.observe("r1", digest(101.0, kv_events=wire_stream(6, [], KVSnapshot(6, hashes[:4]))))
    assert s.index.in_sync("r1") and s.index.match(hashes, ["r1"]) == {"r1": 4}


def test_a_requests_hashes_are_kept_where_the_garbage_collector_never_scans_them():
    import gc

    from pagedserve.serve_app.routing.router_state import kept_hashes
    hashes = [hash((i, "block")) for i in range(450)]
    kept = kept_hashes(hashes)
    assert list(kept) == hashes and not any(isinstance(r, int) for r in gc.get_referents(kept))
    assert kept_hashes([1 << 70, 2]) == (1 << 70, 2)  # beyond int64: a tuple
    state = RouterState()
    state.observe("r1", {"version": DIGEST_VERSION, "time": 1.0, "kv_events": None})
    state.choose("q1", hashes, ["r1"])
    assert state.index.match(hashes, ["r1"]) == {"r1": 450}


def test_a_prompt_queues_the_blocks_its_replica_lacks_until_its_first_output():
    s, clock = state()
    live = ["r1", "r2"]
    hashes = block_hashes(prompt(0), BS)  # 9 full blocks
    s.observe("r1", digest(99.0, hashes[:8]))  # r1 holds the system prompt
    d = s.choose("q1", hashes, live)
    assert (d.replica_id, d.reason) == ("r1", AFFINITY)
    assert s.loads.queued_prefill == {"r1": 1}  # only the block it lacks
    unique = block_hashes(list(range(7000, 7024)), BS)  # 6 blocks nobody holds
    busy = s.choose("q2", unique, live).replica_id
    assert s.loads.queued_prefill[busy] == 6 + (busy == "r1")
    s.first_output("q1")
    assert s.loads.queued_prefill[busy] == 6
    # A replica with a prompt queued loses the two choices to one with more requests, all
    # decoding: a new prompt would wait for that prefill.
    s.completed("q1")
    other = "r2" if busy == "r1" else "r1"
    s.observe(other, digest(clock.now, running=5))
    assert (s.load(busy), s.load(other)) == (1, 5)
    assert s.choose("q3", [], live).replica_id == other
    s.first_output("q2")
    assert s.choose("q4", [], live).replica_id == busy  # prefilled: load decides again


def test_a_steps_report_ends_its_finished_requests_then_counts_its_load():
    """Each engine step's outputs bring the replica's queue depth as of the step: it replaces the
    projection from the last digest, and the requests that finished in that step end as of it,
    so that their streams closing later take nothing off a count that no longer holds them."""
    s, clock = state()
    s.observe("r1", digest(100.0, arrived=0))
    s.observe("r2", digest(100.0, arrived=0))
    s.loads.send_weight = 4.0  # three other ingresses send as much as this one
    clock.now = 100.2
    for request_id in ("q1", "q2"):
        s.choose(request_id, [], ["r1"])
    assert s.load("r1") == 8  # two sends, about eight from every ingress
    s.observe_step("r1", ["q1", "q2"], ["q1"], (100.3, 5, 6, 0))
    assert s.load("r1") == 5
    clock.now = 100.35
    s.completed("q1")  # its stream closes: the report already took it off
    assert s.load("r1") == 5
    s.observe("r1", digest(100.25, running=9, arrived=5))  # taken before that step: late
    assert s.load("r1") == 5
    s.choose("q3", [], ["r1"])
    assert s.load("r1") == 5 + 4
    s.observe_step("r1", [], [], (100.4, 6, 7, 0))
    assert s.load("r1") == 6


def test_a_steps_report_brings_the_replicas_prefill_queue_and_its_outputs_end_ours():
    s, clock = state()
    live = ["r1", "r2"]
    prompt_hashes = block_hashes(list(range(40)), BS)  # 10 blocks nobody holds
    for replica_id in live:
        s.observe(replica_id, digest(100.0))
    s.loads.send_weight = 2.0  # another ingress sends as much as this one
    clock.now = 100.2
    d = s.choose("q1", prompt_hashes, live)
    assert s.loads.queued_prefill[d.replica_id] == 10
    # The replica's next step: q1 had its first output; other ingresses' prompts wait there.
    s.observe_step(d.replica_id, ["q1"], [], (100.3, 3, 3, 25))
    assert s.loads.queued_prefill[d.replica_id] == 25
    s.first_output("q1")  # its stream's first output, later: already counted off
    assert s.loads.queued_prefill[d.replica_id] == 25


def test_an_adapters_requests_go_to_its_holders_until_they_are_loaded_then_spread():
    s, clock = state(adapter_max_excess_load=4)
    live = ("r1", "r2", "r3")
    for replica in live:
        s.observe(replica, {**digest(clock.now), "lora_resident_ids": [7] if replica == "r2" else []})
    for turn in range(6):  # different prompts: only the adapter pulls them together
        hashes = block_hashes([turn] * 8, BS)
        decision = s.choose(None, hashes, live, adapter_id=7)
        assert decision.replica_id == "r2" and set(decision.ranked) == set(live)
    first = s.choose(None, block_hashes([99] * 8, BS), live, adapter_id=8)  # held nowhere
    s.dispatched("q", first.replica_id, [], first, adapter_id=8)
    again = s.choose(None, block_hashes([98] * 8, BS), live, adapter_id=8)
    assert again.replica_id == first.replica_id  # sent there: it holds it now
    clock.now += 1
    s.observe("r2", {**digest(clock.now, waiting=3, running=3), "lora_resident_ids": [7]})
    spread = s.choose(None, block_hashes([5] * 8, BS), live, adapter_id=7)
    assert spread.replica_id != "r2"  # its holder is over the guard: the adapter spreads
