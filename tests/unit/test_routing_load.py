from serve_app.routing.load import LoadTracker


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
    import serve_app.routing.load as load_module
    monkeypatch.setattr(load_module, "MAX_IN_FLIGHT", 3)
    loads = LoadTracker()
    for i in range(3):
        loads.sent(f"old{i}", "r1", now=0.0)
    loads.sent("new", "r1", now=load_module.IN_FLIGHT_TTL_S + 1)
    assert loads.load("r1") == 1


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


def test_queued_prefill_follows_a_reroute_and_forgets_dead_replicas():
    loads = LoadTracker()
    loads.sent("q1", "r1", now=1.0, prefill_blocks=4)
    loads.sent("q1", "r2", now=1.1, prefill_blocks=6)  # the first choice was full
    assert loads.queued_prefill == {"r1": 0, "r2": 6}
    loads.retain(["r1"])
    assert loads.queued_prefill == {"r1": 0}
    loads.prefilled("q1")  # unknown by now: no error
    loads.completed("q1")
