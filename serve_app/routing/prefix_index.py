"""Which replica holds which prefix: block hash -> replicas, in the replicas' own token space.

Fed two ways. Each replica's digest (about once a second) carries its KV-cache events, which a
`CacheMirror` per replica applies: that is what the replica holds, exactly. Between digests, the
router inserts a request's block hashes optimistically for the replica it sends the request to:
that replica will hold them once it prefills, and the next request with the same prefix must find
them before the next digest says so. An optimistic entry lives until a digest taken
`optimistic_ttl_s` after the insert has had time to show it (or to show that it was evicted again).

Hashes are chained (`pagedserve.replicas.core.block_hash`), so one hash names a whole prefix; a match is the number
of leading blocks of a request that a replica holds. The inverted index (hash -> replicas holding
it, by mirror or optimistically) is kept from the mirrors' changes and the inserts, so a match
costs the request's blocks times the replicas that hold them, not the fleet's size.

A hot prompt's shared part (an llm-d tenant's 6,000-token context: 375 blocks) has one holder set
all along, and looking each of its blocks up in a large, cache-cold index was most of a decision.
So the index remembers such runs: from a chain's first block, the length, the last hash and the
holder set of its leading blocks that all have that one holder set (the bookkeeping that forgets
them waits for the next digest). Since hashes are chained, a request whose block at the run's last
position equals the run's last hash shares every block before it, and skips their lookups
(`prefix_runs`). A run is forgotten as soon as any of its blocks changes holders, so matches stay
exact; unless all of them gain the same replica at once (a prompt sent past its holders), which
leaves them one holder set.

A request whose prompt nobody holds yet (a tenant's first long context: hundreds of fresh blocks)
was slow to enter into that index, the slowest decisions at a thousand replicas. So a
long fresh tail of an optimistic insert waits as a lazy tail instead: until the replica's next
digest enters it (off the decision path), a request with the same first block compares its hashes
with the tail's by position (chained hashes: equal at a position means equal before it, so the
common length is a binary search). Pure Python.
"""
from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from itertools import groupby, islice, repeat
from operator import indexOf, itemgetter
from typing import Any

from pagedserve.serve_app.routing.cache_mirror import CacheMirror
from pagedserve.serve_app.routing.prefix_runs import PrefixRuns

DEFAULT_OPTIMISTIC_TTL_S = 10.0
# Leading blocks with one holder set from which a run is remembered: below this, looking them up
# costs about what remembering them does.
RUN_MIN_BLOCKS = 16
# Fresh blocks of an optimistic insert from which they wait as a lazy tail (see above): a query's
# own blocks (a 1,200-token question: ~75) enter the index at once, a cold context does not.
LAZY_MIN_BLOCKS = 128
_EMPTY: frozenset = frozenset()


@dataclass(slots=True)
class PrefixMatch:
    """How many leading blocks of a request each replica holds: `common` for every replica but
    those in `deeper`, each of which holds more."""
    common: int = 0
    deeper: dict[str, int] = field(default_factory=dict)

    @property
    def best(self) -> int:
        return max(self.deeper.values(), default=self.common)

    def get(self, replica_id: str) -> int:
        return self.deeper.get(replica_id, self.common)


class _Holders:
    """One replica's mirror listener: its confirmed hashes enter and leave the inverted index,
    unless an optimistic entry holds them there anyway."""

    __slots__ = ("index", "replica_id")

    def __init__(self, index: "PrefixIndex", replica_id: str):
        self.index, self.replica_id = index, replica_id

    def stored(self, block_hashes: Iterable[int]) -> None:
        optimistic = self.index._stamped(self.replica_id) or _EMPTY
        self.index._add(self.replica_id, (h for h in block_hashes if h not in optimistic))

    def removed(self, block_hashes: Iterable[int]) -> None:
        optimistic = self.index._stamped(self.replica_id) or _EMPTY
        self.index._discard(self.replica_id, (h for h in block_hashes if h not in optimistic))


class PrefixIndex:
    def __init__(self, optimistic_ttl_s: float = DEFAULT_OPTIMISTIC_TTL_S,
                 run_min_blocks: int = RUN_MIN_BLOCKS, lazy_min_blocks: int = LAZY_MIN_BLOCKS):
        self.optimistic_ttl_s = optimistic_ttl_s
        self.run_min_blocks = run_min_blocks
        self.lazy_min_blocks = lazy_min_blocks
        self._mirrors: dict[str, CacheMirror] = {}  # replica -> what its event stream says it holds
        self._optimistic: dict[str, dict[int, float]] = {}  # replica -> hash -> inserted at
        # replica -> (inserted at, hashes) per insert, oldest first: what the TTL expires
        self._inserts: dict[str, deque[tuple[float, Sequence[int]]]] = {}
        # replica -> the inserts not yet stamped into `_optimistic`. Only the digest's events,
        # the TTL and a take-back read the stamps, so a decision leaves them to the next of
        # those: a prompt's every hash, stamped per request, was a third of a decision's cost.
        self._unstamped: dict[str, list[tuple[float, Sequence[int]]]] = {}
        self._report_time: dict[str, float] = {}
        # hash -> the replicas holding it, by their mirror or optimistically
        self._holders: dict[int, frozenset[str]] = {}
        self._single: dict[str, frozenset[str]] = {}  # replica -> frozenset((replica,))
        self.runs = PrefixRuns()  # of leading blocks with one holder set, by first block
        # first hash of a chain -> its lazy tails [(replica, hashes, start)]: the replica holds
        # hashes[start:] optimistically, not yet in `_holders` (it holds hashes[:start] there)
        self._lazy: dict[int, list[tuple[str, Sequence[int], int]]] = {}
        self._lazy_of: dict[str, list[tuple[str, Sequence[int], int]]] = {}  # by replica

    @property
    def replica_ids(self) -> set[str]:
        return set(self._mirrors) | set(self._optimistic)

    def report_time(self, replica_id: str) -> float | None:
        return self._report_time.get(replica_id)

    def in_sync(self, replica_id: str) -> bool:
        """Whether what we know of replica_id's cache is exact (see CacheMirror)."""
        mirror = self._mirrors.get(replica_id)
        return mirror is not None and mirror.in_sync

    def observe(self, replica_id: str, kv_events: Mapping[str, Any] | None,
                report_time: float) -> None:
        """Apply replica_id's digest taken at report_time: its KV event stream, if it caches."""
        mirror = self._mirrors.get(replica_id)
        if mirror is None:
            mirror = self._mirrors[replica_id] = CacheMirror(_Holders(self, replica_id))
        if replica_id in self._lazy_of:  # the events below may name its blocks
            self._enter_lazy(replica_id)
        self.runs.settle()  # what the decisions since the last digest left (see prefix_runs)
        if kv_events is not None:
            mirror.apply(kv_events)
        self._report_time[replica_id] = report_time
        inserts = self._inserts.get(replica_id)
        if inserts:
            self._expire(replica_id, inserts, report_time - self.optimistic_ttl_s)

    def insert(self, replica_id: str, block_hashes: Sequence[int], now: float,
               num_held: int = 0) -> None:
        """Optimistically record that replica_id is about to hold these blocks (the sequence is
        kept, not copied). num_held: how many leading ones it holds already, by the match the
        decision was made on; the index changes only past them."""
        unstamped = self._unstamped.get(replica_id)
        if unstamped is None:
            self._optimistic.setdefault(replica_id, {})
            self._inserts.setdefault(replica_id, deque())
            unstamped = self._unstamped[replica_id] = []
        unstamped.append((now, block_hashes))
        self._inserts[replica_id].append((now, block_hashes))
        # Sent past the holders of its leading blocks, a prompt's remembered run says who holds
        # them all, without looking each up (a cache-cold index: the slowest decisions).
        known = 0 if num_held else self.runs.length(block_hashes)
        if len(block_hashes) - num_held >= self.lazy_min_blocks:
            # Blocks others hold enter the index now (their holders change); the rest may wait.
            start = max(num_held, known)
            try:  # the first block nobody holds, found in C
                fresh = start + indexOf(map(self._holders.__contains__,
                                            islice(block_hashes, start, None)), False)
            except ValueError:
                fresh = len(block_hashes)
            if len(block_hashes) - fresh >= self.lazy_min_blocks:
                self._add(replica_id, block_hashes[num_held:fresh], not num_held, known)
                tail = (replica_id, block_hashes, fresh)
                self._lazy.setdefault(block_hashes[0], []).append(tail)
                self._lazy_of.setdefault(replica_id, []).append(tail)
                return
        self._add(replica_id, block_hashes[num_held:] if num_held else block_hashes,
                  not num_held, known)

    def remove(self, replica_id: str, block_hashes: Iterable[int], inserted_at: float) -> None:
        """Take back an optimistic insert made at inserted_at (the request went elsewhere); hashes
        inserted again since, for another request, stay."""
        self._enter_lazy(replica_id)
        optimistic = self._stamped(replica_id)
        if optimistic:
            gone = [h for h in block_hashes if optimistic.get(h) == inserted_at]
            self._drop_optimistic(replica_id, optimistic, gone)

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone."""
        live = set(live_replica_ids)
        for replica_id in [r for r in self.replica_ids if r not in live]:
            self._enter_lazy(replica_id, enter=False)
            held = set(self._confirmed(replica_id)) | set(self._stamped(replica_id) or ())
            self._discard(replica_id, held)
        for table in (self._mirrors, self._optimistic, self._inserts, self._unstamped,
                      self._report_time, self._single):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    def holds(self, replica_id: str, block_hash: int) -> bool:
        self._enter_all_lazy()
        return replica_id in self._holders.get(block_hash, _EMPTY)

    def holders(self, block_hash: int) -> set[str]:
        self._enter_all_lazy()
        return set(self._holders.get(block_hash, _EMPTY))

    def prefix_match(self, block_hashes: Sequence[int], live: Set[str]) -> PrefixMatch:
        """The leading blocks of the request each live replica holds; `live` must be a set (or
        dict keys). A chain's blocks mostly share one holder set (see `_add`), so the walk is per
        run of blocks with the same holders, in C but for the runs, and skips a remembered run;
        the lazy tails of the request's first block are compared by position after it."""
        found = self._index_match(block_hashes, live)
        tails = self._lazy.get(block_hashes[0]) if block_hashes and self._lazy else None
        if tails:
            found = self._with_tails(found, block_hashes, tails, live)
        return found

    def _index_match(self, block_hashes: Sequence[int], live: Set[str]) -> PrefixMatch:
        if not block_hashes:
            return PrefixMatch()
        root = block_hashes[0]
        first_held = self._holders.get(root, _EMPTY)
        survivors = first_held & live  # holding every block so far
        common = None if len(survivors) == len(live) else 0  # None: every live replica so far
        if not survivors:  # a cold prefix
            return PrefixMatch()
        num_blocks = len(block_hashes)
        # Blocks walked; of them, those known to have first_held as holders (a run's holders are
        # its first block's).
        start = known = self.runs.length(block_hashes)
        rest = islice(block_hashes, start, None) if start else block_hashes
        # Lazily: the walk mostly stops at the first block nobody holds (a query's own blocks).
        held_by = map(self._holders.get, rest, repeat(_EMPTY))
        deeper: dict[str, int] = {}
        first_run = start  # the leading blocks that have first_held as holders
        for held, run in groupby(held_by):
            if start == first_run and held == first_held:
                start = first_run = start + len(list(run))
                continue
            if not survivors <= held:
                remaining = survivors & held
                if common is None:
                    common = start  # those that stop here hold what every replica holds: unlisted
                else:
                    deeper.update(zip(survivors - remaining, repeat(start)))
                survivors = remaining
                if not survivors:
                    break
            start += len(list(run))
        if first_run > known and first_run >= self.run_min_blocks:
            self.runs.remember(block_hashes, known, first_run, first_held)
        if common is None:
            return PrefixMatch(num_blocks if survivors else 0)
        deeper.update(zip(survivors, repeat(num_blocks)))
        return PrefixMatch(common, deeper)

    def match(self, block_hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """For each replica: how many leading blocks of the request it holds."""
        replica_ids = list(replica_ids)
        found = self.prefix_match(block_hashes, set(replica_ids))
        return {r: found.get(r) for r in replica_ids}

    def num_blocks(self, replica_id: str) -> int:
        self._enter_all_lazy()
        return len(self._confirmed(replica_id) | set(self._stamped(replica_id) or ()))

    # -- internals ------------------------------------------------------------------------------
    def _with_tails(self, found: PrefixMatch, block_hashes: Sequence[int],
                    tails: list[tuple[str, Sequence[int], int]], live: Set[str]) -> PrefixMatch:
        """`found` (the index's match) with what the lazy tails of the request's chain add."""
        holders, num_blocks = self._holders, len(block_hashes)
        if len(tails) > 1:  # a tail can only reach past another's start: take them in start order
            tails = sorted(tails, key=itemgetter(2))
        for replica_id, tail, start in tails:
            if replica_id not in live:
                continue
            held = found.get(replica_id)
            if held < start:  # the blocks before the tail are gone from it: the tail is unreached
                continue
            common = _common_length(block_hashes, tail)
            if common <= held:
                continue
            while common < num_blocks and replica_id in holders.get(block_hashes[common], _EMPTY):
                common += 1  # blocks past the tail it holds by the index
            found.deeper[replica_id] = common
        return found

    def _enter_lazy(self, replica_id: str, enter: bool = True) -> None:
        """Enter replica_id's lazy tails into the index (or, for a replica that is gone, drop them)."""
        for tail in self._lazy_of.pop(replica_id, ()):
            root = tail[1][0]
            rest = [t for t in self._lazy[root] if t is not tail]
            if rest:
                self._lazy[root] = rest
            else:
                del self._lazy[root]
            if enter:
                self._add(replica_id, tail[1][tail[2]:])

    def _enter_all_lazy(self) -> None:
        for replica_id in list(self._lazy_of):
            self._enter_lazy(replica_id)

    def _confirmed(self, replica_id: str) -> set[int] | frozenset:
        mirror = self._mirrors.get(replica_id)
        return mirror.block_hashes if mirror is not None else _EMPTY

    def _add(self, replica_id: str, block_hashes: Iterable[int], from_root: bool = False,
             known: int = 0) -> None:
        """replica_id holds block_hashes. from_root: they are a chain's leading blocks (an
        insert's, none held before by the replica), so a remembered run that they grow whole stays
        true, with replica_id among its holders: a prompt sent past its holders (load-override)
        leaves its runs for the next request, which otherwise walked its every block again.
        known: the leading blocks a remembered run covers (from_root only), which all have the
        first block's holders."""
        # Holder sets are frozensets, shared: every hash that only replica_id holds points at one
        # object, so the blocks of a miss enter the index in one C-level pass.
        holders = self._holders
        single = self._single.get(replica_id)
        if single is None:
            single = self._single[replica_id] = frozenset((replica_id,))
        if not isinstance(block_hashes, (list, tuple, array)):
            block_hashes = list(block_hashes)
        # One pass over the (large, cache-cold) index: fresh hashes get `single`, the rest say
        # who held them. Mostly all are fresh or this replica's alone, which `count` sees in C.
        if known:
            held_by = [holders[block_hashes[0]]] * known
            held_by += map(holders.setdefault, block_hashes[known:], repeat(single))
        else:
            held_by = list(map(holders.setdefault, block_hashes, repeat(single)))
        if held_by.count(single) == len(held_by):
            return
        # The rest change holders by runs of blocks that had one holder set (a shared context's
        # blocks all have the same): each run in one C-level update.
        forget = self.runs.forget if self.runs and not from_root else None
        grown: dict[frozenset[str], frozenset[str]] = {}  # so equal holder sets stay one object
        end = 0
        for held, group in groupby(held_by):
            start, end = end, end + len(list(group))
            if replica_id not in held:
                more = grown.get(held)
                if more is None:
                    more = grown[held] = held | single
                segment = block_hashes[start:end]
                holders.update(zip(segment, repeat(more)))
                if forget is not None:
                    forget(segment)
        if from_root:
            self.runs.grow(block_hashes, grown.get(held_by[0]))

    def _discard(self, replica_id: str, block_hashes: Iterable[int]) -> None:
        holders = self._holders
        single = self._single.get(replica_id, _EMPTY)
        shrunk: dict[frozenset[str], frozenset[str]] = {}
        changed = []  # their runs are forgotten
        for block_hash in block_hashes:
            held = holders.get(block_hash)
            if held is not None and replica_id in held:
                changed.append(block_hash)
                if len(held) == 1:
                    del holders[block_hash]
                    continue
                fewer = shrunk.get(held)
                if fewer is None:
                    fewer = shrunk[held] = held - single
                holders[block_hash] = fewer
        if changed and self.runs:
            self.runs.forget(changed)

    def _stamped(self, replica_id: str) -> dict[int, float] | None:
        """replica_id's optimistic hashes, each with its last insert's time."""
        optimistic = self._optimistic.get(replica_id)
        unstamped = self._unstamped.get(replica_id)
        if unstamped:
            for at, block_hashes in unstamped:
                optimistic.update(zip(block_hashes, repeat(at)))
            unstamped.clear()
        return optimistic

    def _expire(self, replica_id: str, inserts: deque, horizon: float) -> None:
        optimistic = self._stamped(replica_id)
        while inserts and inserts[0][0] <= horizon:
            at, block_hashes = inserts.popleft()
            gone = [h for h in block_hashes if optimistic.get(h) == at]
            self._drop_optimistic(replica_id, optimistic, gone)

    def _drop_optimistic(self, replica_id: str, optimistic: dict[int, float],
                         gone: list[int]) -> None:
        for block_hash in gone:
            optimistic.pop(block_hash, None)
        confirmed = self._confirmed(replica_id)
        self._discard(replica_id, (h for h in gone if h not in confirmed))


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading hashes two chains share: chained hashes agree at a position exactly when
    they agree at every position before it, so a binary search finds it."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[hi] != b[hi] or hi is the end
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo

