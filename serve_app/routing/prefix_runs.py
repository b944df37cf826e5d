"""Remembered runs (see `prefix_index`): from a chain's first block, the length, the last hash and
the holder set of leading blocks that all have that one holder set, so a match skips their lookups.

Every block of a run has the run's holder set; whoever changes a block's holders tells `forget`
(each block points at its run's first block), unless a chain's leading blocks all gain the same
replica at once (`grow`), which leaves a run within them one holder set.

Pointing a run's blocks at its first one (hundreds of dict inserts for an llm-d tenant's context)
was a large share of a decision that remembers a run, the slowest decisions at a thousand
replicas. Only `forget` reads those pointers, and no block changes holders without it, so
`remember` leaves them pending: `settle` writes them, off the decision path (the index's next
digest) or first thing in `forget`. Pure Python.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice, repeat

RUNS_PER_ROOT = 4  # prompts that share a first block and a holder set past where they part


class PrefixRuns:
    __slots__ = ("by_root", "root_of", "_pending")

    def __init__(self):
        # first hash of a chain -> its remembered runs, [(length, last hash, holders)]
        self.by_root: dict[int, list[tuple[int, int, frozenset[str]]]] = {}
        self.root_of: dict[int, int] = {}  # hash -> the first hash of the runs covering it
        # runs remembered since the last settle: (hashes, from, to), blocks not yet in root_of
        self._pending: list[tuple[Sequence[int], int, int]] = []

    def __bool__(self) -> bool:
        return bool(self.root_of or self._pending)

    def length(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of block_hashes a remembered run covers (0: none). Chained
        hashes: equal last hashes mean equal blocks before them."""
        runs = self.by_root.get(block_hashes[0]) if block_hashes else None
        if not runs:
            return 0
        num = len(block_hashes)
        return max((length for length, last, _ in runs
                    if length <= num and block_hashes[length - 1] == last), default=0)

    def remember(self, block_hashes: Sequence[int], known: int, length: int,
                 held: frozenset[str]) -> None:
        """Blocks [0, length) of block_hashes have `held` as holders ([0, known) remembered
        already, under the same first block)."""
        root = block_hashes[0]
        runs = [r for r in self.by_root.get(root, ()) if r[0] != known][-(RUNS_PER_ROOT - 1):]
        runs.append((length, block_hashes[length - 1], held))
        self.by_root[root] = runs
        self._pending.append((block_hashes, known, length))

    def settle(self) -> None:
        """Point the blocks of the runs remembered since the last call at their first blocks."""
        root_of = self.root_of
        for block_hashes, known, length in self._pending:
            root_of.update(zip(islice(block_hashes, known, length), repeat(block_hashes[0])))
        self._pending.clear()

    def forget(self, block_hashes: Iterable[int]) -> None:
        """These blocks change holders: the runs over them no longer say who holds their blocks."""
        if self._pending:
            self.settle()
        roots = set(map(self.root_of.pop, block_hashes, repeat(None)))
        roots.discard(None)
        for root in roots:
            self.by_root.pop(root, None)

    def grow(self, block_hashes: Sequence[int], more: frozenset[str] | None) -> None:
        """block_hashes, a chain's leading blocks, went to the holder set `more` where their first
        did (None: it kept its holders, so no block of a run over it changed: they all share its
        holders). A run within them changed whole and stays; one past their end (or off their
        chain) changed in part and is forgotten. No other root's run holds a block of this chain:
        a chained hash names its whole prefix."""
        root = block_hashes[0]
        runs = self.by_root.get(root)
        if more is None or not runs:
            return
        num = len(block_hashes)
        kept = [(length, last, more) for length, last, _ in runs
                if length <= num and block_hashes[length - 1] == last]
        if kept:
            self.by_root[root] = kept
        else:
            del self.by_root[root]
