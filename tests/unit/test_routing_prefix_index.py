from pagedserve.replicas.core.block_hash import block_hashes
from pagedserve.replicas.core.kv_events import BlockRemoved, KVSnapshot, encode_event, wire_stream
from pagedserve.serve_app.routing.prefix_index import PrefixIndex

BS = 4
A = block_hashes(list(range(16)), BS)  # 4 blocks
B = block_hashes(list(range(100, 116)), BS)


def snapshot(hashes, seq=0):
    """A digest's stream that says: the replica holds exactly these."""
    return wire_stream(seq, [], KVSnapshot(seq, list(hashes)))


def test_match_counts_leading_blocks_per_replica():
    index = PrefixIndex()
    index.observe("r1", snapshot(A[:3]), report_time=1.0)
    index.observe("r2", snapshot(A[:1] + B), report_time=1.0)
    assert index.match(A, ["r1", "r2", "r3"]) == {"r1": 3, "r2": 1, "r3": 0}
    assert index.match(B, ["r1", "r2"]) == {"r1": 0, "r2": 4}
    assert index.holders(A[0]) == {"r1", "r2"}


def test_a_hole_in_the_chain_ends_the_match():
    index = PrefixIndex()
    index.observe("r1", snapshot([A[0], A[2], A[3]]), report_time=1.0)  # A[1] evicted
    assert index.match(A, ["r1"]) == {"r1": 1}


def test_a_snapshot_replaces_what_we_knew_and_events_update_it():
    index = PrefixIndex()
    index.observe("r1", snapshot(A), report_time=1.0)
    index.observe("r1", snapshot(B, seq=5), report_time=2.0)
    assert index.match(A, ["r1"]) == {"r1": 0}
    assert index.match(B, ["r1"]) == {"r1": 4}
    index.observe("r1", wire_stream(6, [encode_event(5, BlockRemoved([B[2]]))], None), 3.0)
    assert index.match(B, ["r1"]) == {"r1": 2} and index.in_sync("r1")


def test_optimistic_insert_survives_digests_until_its_ttl():
    index = PrefixIndex(optimistic_ttl_s=5.0)
    index.insert("r1", A, now=10.0)
    assert index.match(A, ["r1"]) == {"r1": 4}
    index.observe("r1", snapshot([]), report_time=14.0)  # too soon to show a request sent at 10.0
    assert index.match(A, ["r1"]) == {"r1": 4}
    index.observe("r1", snapshot(A[:2]), report_time=15.0)  # by now it shows what really stayed
    assert index.match(A, ["r1"]) == {"r1": 2}


def test_remove_takes_back_only_that_insert():
    index = PrefixIndex()
    index.insert("r1", A, now=1.0)
    index.insert("r1", A[:2], now=2.0)  # another request shares the first two blocks
    index.remove("r1", A, inserted_at=1.0)
    assert index.match(A, ["r1"]) == {"r1": 2}


def test_retain_forgets_dead_replicas():
    index = PrefixIndex()
    index.observe("r1", snapshot(A), report_time=1.0)
    index.insert("r2", B, now=1.0)
    index.retain(["r1"])
    assert index.replica_ids == {"r1"}
    assert index.holders(B[0]) == set()



def test_a_remembered_run_skips_its_lookups_and_is_forgotten_when_its_blocks_change(monkeypatch):
    context = block_hashes(list(range(40 * BS)), BS)  # 40 blocks, held by r1 and r2
    index = PrefixIndex(run_min_blocks=8)
    index.observe("r1", snapshot(context), report_time=1.0)
    index.observe("r2", snapshot(context[:30]), report_time=1.0)
    query = context + block_hashes(list(range(40 * BS)) + [7] * BS, BS)[40:]
    assert index.match(query, ["r1", "r2", "r3"]) == {"r1": 40, "r2": 30, "r3": 0}
    assert [length for length, _, _ in index.runs.by_root[context[0]]] == [30]
    looked_up = []
    holders_get = index._holders.get
    monkeypatch.setattr(index, "_holders", type("Spy", (dict,), {
        "get": lambda self, h, d=None: looked_up.append(h) or holders_get(h, d)})(index._holders))
    assert index.match(query, ["r1", "r2", "r3"]) == {"r1": 40, "r2": 30, "r3": 0}
    assert context[5] not in looked_up and context[30] in looked_up  # the run's blocks skipped
    monkeypatch.undo()
    # r2 evicts a block inside the run: the run is forgotten and the match is exact again
    index.observe("r2", wire_stream(1, [encode_event(0, BlockRemoved([context[12]]))], None), 2.0)
    assert context[0] not in index.runs.by_root
    assert index.match(query, ["r1", "r2"]) == {"r1": 40, "r2": 12}
    assert [length for length, _, _ in index.runs.by_root[context[0]]] == [12]
    # r3 is sent the whole prompt (past its holders): the run's blocks all gain r3, so it stays
    index.insert("r3", query, now=2.0)
    assert [(length, held) for length, _, held in index.runs.by_root[context[0]]] == [
        (12, frozenset({"r1", "r2", "r3"}))]
    looked_up.clear()
    monkeypatch.setattr(index, "_holders", type("Spy", (dict,), {
        "get": lambda self, h, d=None: looked_up.append(h) or holders_get(h, d)})(index._holders))
    assert index.match(query, ["r1", "r2", "r3"]) == {"r1": 40, "r2": 12, "r3": 41}
    assert context[5] not in looked_up and context[12] in looked_up
    monkeypatch.undo()
    # r4 is sent the first 8 blocks only: the run reaches past them, so it is forgotten
    index.insert("r4", query[:8], now=2.0)
    assert context[0] not in index.runs.by_root
    assert index.match(query, ["r1", "r2", "r3", "r4"]) == {"r1": 40, "r2": 12, "r3": 41, "r4": 8}
    # r5 is sent the whole prompt too: the run remembered again says who holds its blocks, so
    # the insert looks none of them up
    assert [length for length, _, _ in index.runs.by_root[context[0]]] == [8]
    touched = []

    class Spy(dict):
        def setdefault(self, h, d=None):
            touched.append(h)
            return super().setdefault(h, d)

        def __contains__(self, h):
            touched.append(h)
            return super().__contains__(h)

    index._holders = Spy(index._holders)
    index.insert("r5", query, now=2.0)
    assert context[5] not in touched and context[8] in touched
    assert index.match(query, ["r1", "r2", "r5"]) == {"r1": 40, "r2": 12, "r5": 41}


def test_a_run_remembered_since_the_last_digest_is_still_forgotten_when_its_blocks_change():
    """A decision leaves a run's bookkeeping to the next digest; a change before then (a take-back
    on the request path) must still forget it, or the next match skips blocks that changed."""
    context = block_hashes(list(range(40 * BS)), BS)
    index = PrefixIndex(run_min_blocks=8)
    index.observe("r1", snapshot(context), report_time=1.0)
    index.insert("r2", context[:30], now=1.0)
    index.insert("r2", context[:5], now=2.0)  # another request shares its first 5 blocks
    assert index.match(context, ["r1", "r2"]) == {"r1": 40, "r2": 30}
    assert [length for length, _, _ in index.runs.by_root[context[0]]] == [30]
    index.remove("r2", context[:30], inserted_at=1.0)  # the first went elsewhere: r2 keeps 5
    assert context[0] not in index.runs.by_root
    assert index.match(context, ["r1", "r2"]) == {"r1": 40, "r2": 5}


def test_a_cold_prompt_waits_as_a_lazy_tail_matched_by_position_until_the_digest():
    context = block_hashes(list(range(30 * BS)), BS)  # nobody holds it
    index = PrefixIndex(lazy_min_blocks=8)
    index.observe("r1", snapshot(context[:2]), report_time=1.0)
    index.insert("r2", context, now=1.0)
    assert not any(h in index._holders for h in context[2:])  # the decision indexed no fresh block
    assert index._holders[context[0]] == {"r1", "r2"}  # the blocks r1 holds did enter
    follow_up = context[:20] + block_hashes(list(range(20 * BS)) + [9] * BS, BS)[20:]
    assert index.match(follow_up, ["r1", "r2", "r3"]) == {"r1": 2, "r2": 20, "r3": 0}
    assert index.match(context, ["r2"]) == {"r2": 30}
    index.insert("r1", context, now=1.5, num_held=2)  # r1 held the first two: its tail starts there
    assert index.match(context, ["r1", "r2"]) == {"r1": 30, "r2": 30}
    index.observe("r2", None, report_time=2.0)  # r2's digest: its tail enters the index
    assert all(index._holders[h] >= {"r2"} for h in context) and "r2" not in index._lazy_of
    assert index.match(follow_up, ["r1", "r2", "r3"]) == {"r1": 20, "r2": 20, "r3": 0}
    assert "r1" in index._lazy_of
    index.retain(["r2"])  # r1 is gone, and so is its lazy tail
    assert not index._lazy and index.match(context, ["r1", "r2"]) == {"r1": 0, "r2": 30}
