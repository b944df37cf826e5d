from pagedserve.serve_app.routing.load import WEIGHING_REPORTS, WEIGHING_SPACING_S, LoadTracker


def test_load_is_report_plus_sends_since_it():
    loads = LoadTracker()
    loads.report("r1", 3, report_time=10.0)
    assert loads.load("r1") == 3
    loads.sent("q1", "r1", now=10.5)
    loads.sent("q2", "r1", now=10.6)
    assert loads.load("r1") == 5
    loads.completed("q1")
    assert loads.load("r1") == 4
    loads.report("r1", 1, report_time=11.0)  # q2 is in this count now
    assert loads.load("r1") == 1
    assert loads.num_sent_since_report("r1") == 0


def test_requests_seen_finishing_after_a_report_leave_its_count():
    loads = LoadTracker()
    loads.sent("q1", "r1", now=9.0)
    loads.sent("q2", "r1", now=9.1)
    loads.report("r1", 2, report_time=10.0)  # both running at report time
    loads.completed("q1")
    assert loads.load("r1") == 1  # a stale report does not push work away from a free replica
    loads.completed("q2")
    loads.completed("q2")  # twice: no effect
    assert loads.load("r1") == 0
    loads.report("r1", 0, report_time=11.0)
    assert loads.load("r1") == 0


def test_a_late_report_does_not_count_requests_that_finished_after_it_was_taken():
    loads = LoadTracker()
    for i, at in enumerate((9.0, 9.1, 10.4)):
        loads.sent(f"q{i}", "r1", now=at)
    loads.completed("q0", now=10.2)  # after the report below was taken, before it arrives
    loads.completed("q2", now=10.5)  # sent after it: never in its count
    loads.report("r1", 2, report_time=10.0)  # q0 and q1 running when it was taken
    assert loads.load("r1") == 1  # q1 alone: q0 is no phantom until the next report
    loads.completed("q1", now=10.6)
    assert loads.load("r1") == 0
    loads.report("r1", 1, report_time=10.3)  # q1 was still running: its finish counts once
    assert loads.load("r1") == 0
    loads.sent("q3", "r1", now=10.7)
    loads.completed("q3", now=11.2)
    loads.report("r1", 1, report_time=11.0)
    assert loads.load("r1") == 0


def test_load_never_goes_negative_with_other_routers_requests():
    loads = LoadTracker()
    loads.sent("q1", "r1", now=9.0)
    loads.report("r1", 0, report_time=10.0)  # q1 had already finished on the replica
    loads.completed("q1")
    assert loads.load("r1") == 0


def test_no_report_yet_counts_every_send():
    loads = LoadTracker()
    loads.sent("q1", "r1", now=1.0)
    loads.sent("q2", "r1", now=2.0)
    assert loads.load("r1") == 2
    loads.completed("q1")
    assert loads.load("r1") == 1


def test_load_follows_a_reroute_and_forgets_dead_replicas():
    loads = LoadTracker()
    loads.sent("q1", "r1", now=1.0)
    assert loads.sent("q1", "r2", now=1.1) == "r1"
    assert (loads.load("r1"), loads.load("r2")) == (0, 1)
    assert loads.sent("q1", "r2", now=1.2) is None
    loads.retain(["r1"])
    assert loads.load("r2") == 0
    loads.completed("q1")  # unknown by now: no error


def test_requests_never_seen_finishing_are_dropped_eventually(monkeypatch):
    import pagedserve.serve_app.routing.load as load_module
    monkeypatch.setattr(load_module, "MAX_IN_FLIGHT", 3)
    loads = LoadTracker()
    for i in range(3):
        loads.sent(f"old{i}", "r1", now=0.0)
    loads.sent("new", "r1", now=load_module.IN_FLIGHT_TTL_S + 1)
    assert loads.load("r1") == 1


def test_the_ttl_drops_requests_never_seen_finishing_oldest_first(monkeypatch):
    import pagedserve.serve_app.routing.load as load_module
    monkeypatch.setattr(load_module, "MAX_IN_FLIGHT", 4)
    loads = LoadTracker()
    for i in range(4):
        loads.sent(f"old{i}", "r1", now=float(i))
    loads.sent("old0", "r2", now=5.0)  # moved: now the newest send
    loads.sent("new", "r1", now=load_module.IN_FLIGHT_TTL_S + 2.5)
    # old1, old2 are past the TTL; old3 (sent at 3.0) and the moved old0 are not
    assert (loads.load("r1"), loads.load("r2")) == (2, 1)


def test_queued_prefill_counts_a_prompt_from_its_send_to_its_first_output():
    loads = LoadTracker()
    loads.sent("q1", "r1", now=1.0, prefill_blocks=5)
    loads.sent("q2", "r1", now=1.1, prefill_blocks=3)
    loads.sent("q3", "r2", now=1.2)  # every block cached there: nothing queued
    assert loads.queued_prefill == {"r1": 8}
    loads.prefilled("q1")
    loads.prefilled("q1")  # a repeat says nothing new
    assert loads.queued_prefill == {"r1": 3} and loads.load("r1") == 2  # still in flight
    loads.completed("q1")
    assert loads.queued_prefill == {"r1": 3}
    loads.completed("q2")  # ended with no first output seen (an error, or not streamed)
    assert loads.queued_prefill == {"r1": 0}


def test_a_reported_prefill_queue_is_everyones_plus_our_sends_since():
    """A step report counts the prompt blocks the replica still has to prefill, other ingresses'
    included; this router adds its own sent after the report was taken. Alone, it keeps its own
    count."""
    alone = LoadTracker()
    alone.sent("q", "r1", now=1.0, prefill_blocks=5)
    alone.report("r1", 1, report_time=2.0, queued_prefill_blocks=40)
    assert alone.queued_prefill == {"r1": 5}
    loads = LoadTracker()
    loads.send_weight = 2.0  # another ingress sends as much as this one
    loads.sent("before", "r1", now=1.0, prefill_blocks=5)
    loads.sent("after", "r1", now=2.5, prefill_blocks=3)
    loads.report("r1", 4, report_time=2.0, queued_prefill_blocks=40)
    assert loads.queued_prefill == {"r1": 43}
    loads.prefilled("before")  # its first output: its blocks were in the report's count
    assert loads.queued_prefill == {"r1": 38}
    loads.report("r1", 4, report_time=3.0, queued_prefill_blocks=2)  # "after" is in it now
    assert loads.queued_prefill == {"r1": 2}
    loads.prefilled("after")  # never below nothing
    assert loads.queued_prefill == {"r1": 0}
    loads.report("r1", 4, report_time=4.0)  # a digest: no count of it, ours stands
    assert loads.queued_prefill == {"r1": 0}


def test_queued_prefill_follows_a_reroute_and_forgets_dead_replicas():
    loads = LoadTracker()
    loads.sent("q1", "r1", now=1.0, prefill_blocks=4)
    loads.sent("q1", "r2", now=1.1, prefill_blocks=6)  # the first choice was full
    assert loads.queued_prefill == {"r1": 0, "r2": 6}
    loads.retain(["r1"])
    assert loads.queued_prefill == {"r1": 0}
    loads.prefilled("q1")  # unknown by now: no error
    loads.completed("q1")


def _sends(loads, replica_id, num, start, prefix):
    for i in range(num):
        at = start + i / 1000
        loads.sent(f"{prefix}{i}", replica_id, now=at)
        loads.completed(f"{prefix}{i}", now=at + 0.0001)


def test_a_router_sending_a_quarter_of_the_arrivals_counts_each_send_four_times():
    loads = LoadTracker()
    loads.report("r1", 0, report_time=10.0, num_arrived=100)
    # Between reports this router sends 20 of the 80 requests r1 received (3 other ingresses).
    _sends(loads, "r1", 20, 10.1, "a")
    loads.report("r1", 5, report_time=11.0, num_arrived=180)
    assert loads.send_weight == 4.0
    loads.sent("q", "r1", now=11.5)  # one send of ours: about four from everyone
    assert loads.load("r1") == 5 + 4
    loads.completed("q", now=11.6)
    assert loads.load("r1") == 5


def test_a_lone_router_counts_its_sends_once():
    loads = LoadTracker()
    loads.report("r1", 0, report_time=10.0, num_arrived=0)
    _sends(loads, "r1", 70, 10.1, "a")
    loads.sent("late", "r1", now=11.2)  # sent after the report below was taken: not in it
    loads.report("r1", 1, report_time=11.0, num_arrived=70)
    assert loads.send_weight == 1.0
    assert loads.load("r1") == 2


def test_the_share_is_measured_over_the_last_few_reports_of_every_replica():
    loads = LoadTracker()
    loads.report("r1", 0, report_time=10.0, num_arrived=0)
    for t in range(11, 11 + WEIGHING_REPORTS - 1):  # half of r1's arrivals are ours
        _sends(loads, "r1", 20, t - 0.9, f"a{t}-")
        loads.report("r1", 0, report_time=t, num_arrived=(t - 10) * 40)
    assert loads.send_weight == 2.0
    for t in range(15, 15 + WEIGHING_REPORTS - 1):  # now a quarter: the old reports age out
        _sends(loads, "r1", 10, t - 0.9, f"b{t}-")
        loads.report("r1", 0, report_time=t, num_arrived=160 + (t - 14) * 40)
    assert loads.send_weight == 4.0


def test_the_send_weight_needs_enough_arrivals_and_survives_a_restart_and_dead_replicas():
    loads = LoadTracker()
    loads.report("r1", 0, report_time=10.0, num_arrived=50)
    loads.report("r2", 0, report_time=10.0, num_arrived=0)
    _sends(loads, "r1", 2, 10.1, "a")
    loads.report("r1", 0, report_time=11.0, num_arrived=90)  # 40 arrivals: too few to weigh
    assert loads.send_weight == 1.0
    _sends(loads, "r2", 8, 11.1, "b")
    loads.report("r2", 0, report_time=11.5, num_arrived=40)  # 80 arrivals, 10 of them ours
    assert loads.send_weight == 8.0
    loads.report("r1", 0, report_time=12.0, num_arrived=3)  # restarted: its history starts over
    assert loads._interval_sums == [8, 40] and loads.send_weight == 8.0
    loads.retain(["r1"])  # r2's interval leaves the sums
    loads.report("r1", 0, report_time=13.0, num_arrived=5)  # 2 arrivals since the restart
    assert loads._interval_sums == [0, 2]
    assert loads.send_weight == 8.0  # too few to weigh again: the last weight stands


def test_a_report_older_than_the_last_one_applied_is_ignored():
    """A step's report (on a core channel, milliseconds old) comes before the digest taken
    earlier (through Ray, a fraction of a second late): the digest must not undo it."""
    loads = LoadTracker()
    loads.report("r1", 2, report_time=11.0)
    loads.report("r1", 7, report_time=10.8)
    assert loads.load("r1") == 2


def test_step_reports_weigh_the_share_over_seconds_not_over_their_last_few():
    """Reports every 10 ms, a quarter of the arrivals ours: weighed over the last five reports
    (40 ms, about 2 arrivals) the share never had enough arrivals to count."""
    loads = LoadTracker()
    arrived = sent = 0
    for step in range(1, 501):  # 5 s of steps, 40 arrivals a second, 10 of them ours
        t = 10.0 + step / 100
        if step % 10 == 0:
            loads.sent(f"q{step}", "r1", now=t - 0.005)
            sent += 1
        arrived = step * 40 // 100
        loads.report("r1", 0, report_time=t, num_arrived=max(arrived, sent))
    assert WEIGHING_SPACING_S * (WEIGHING_REPORTS - 1) * 40 >= 64  # the window holds enough
    assert 3.5 <= loads.send_weight <= 4.5
