from pagedserve.replicas.core.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVSnapshot, encode_event, wire_stream,
)
from pagedserve.serve_app.routing.cache_mirror import CacheMirror


def stream(head, events, snapshot=None, first=None):
    first = head - len(events) if first is None else first
    return wire_stream(head, [encode_event(first + i, e) for i, e in enumerate(events)], snapshot)


def test_a_mirror_is_exact_from_a_replicas_first_event_without_a_snapshot():
    mirror = CacheMirror()
    mirror.apply(stream(2, [BlockStored([1, 2], None), BlockStored([3], 2)]))
    mirror.apply(stream(4, [BlockStored([3], 2), BlockRemoved([1]), AllBlocksCleared()],
                        first=1))  # a window overlapping the last one: event 1 is not re-applied
    assert mirror.in_sync and mirror.block_hashes == set() and mirror.next_seq == 4
    mirror.apply(stream(5, [BlockStored([9], None)]))
    assert mirror.block_hashes == {9} and mirror.num_holes == 0


def test_a_hole_leaves_the_mirror_approximate_until_a_snapshot():
    mirror = CacheMirror()
    mirror.apply(stream(1, [BlockStored([1], None)]))
    mirror.apply(stream(5, [BlockStored([5], None)]))  # events 1..3 never arrived
    assert not mirror.in_sync and mirror.block_hashes == {1, 5} and mirror.num_holes == 1
    mirror.apply(stream(6, [BlockRemoved([1])]))  # still applied: most of what it knows is right
    assert not mirror.in_sync and mirror.block_hashes == {5}
    # the snapshot at 6 replaces everything; the events from 6 on are replayed over it
    mirror.apply(stream(7, [BlockRemoved([1]), BlockStored([7], None)], KVSnapshot(6, [5, 6])))
    assert mirror.in_sync and mirror.block_hashes == {5, 6, 7} and mirror.next_seq == 7


def test_a_report_ahead_of_the_mirror_without_the_events_between_is_a_hole():
    mirror = CacheMirror()
    mirror.apply(stream(3, []))  # three events happened; none came with the report
    assert not mirror.in_sync and mirror.next_seq == 3
