"""Paged KV-cache bookkeeping: block ids, ref counts, and the hash-chained prefix cache.

Pure Python. A block is free when its ref count is 0; free blocks sit in an LRU queue and keep
their hash, so a later request with the same prefix can take them back (a prefix-cache hit)
until an allocation evicts them from the head of the queue.

The queue starts as every block in id order, and a block is made (a `Block`) only when first
taken: blocks freed without a hash go before the never-taken ones, blocks freed with one after
them, so the queue is those three parts in that order. Making every block up front cost time and
memory before a request came, and a simulated fleet builds a thousand caches.

Sliding windows: when every layer attends within a window, no future query of a sequence reads a
position older than num_computed_tokens - window + 1, so the blocks wholly before it are released
(they stay cached, evictable, like any freed block) and their block-table entries become
NULL_BLOCK, a block reserved for that, so positions still map to table indices. A sequence then
holds at most about (window + step tokens) / block_size blocks however long it grows. A prefix
hit likewise needs only the blocks the first computed token's window reaches to be cached: the
chain hash of the last one names the whole prefix, and the older ones become NULL_BLOCK too.
Every attention backend skips the blocks before a query's window, so NULL_BLOCK is never read.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain, islice, repeat
from operator import attrgetter

from pagedserve.replicas.core.kv_events import (
    DEFAULT_LOG_CAPACITY, AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog,
)
from pagedserve.replicas.core.sequence import Sequence
from pagedserve.replicas.core.working_set import WorkingSet

NULL_BLOCK = 0  # with a sliding window: the placeholder of dropped blocks, never allocated


def kv_window_of(sliding_windows: list[int | None] | None) -> int | None:
    """How far back any layer reads: the largest window, or None if some layer attends in full
    (or the model gives no windows), in which case no block is ever dropped."""
    if not sliding_windows or any(w is None for w in sliding_windows):
        return None
    return max(sliding_windows)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept to re-check a hash hit


_ref_count = attrgetter("ref_count")
_token_ids = attrgetter("token_ids")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_events: int = DEFAULT_LOG_CAPACITY, sliding_window: int | None = None):
        """sliding_window: kv_window_of(the model's per-layer windows); None keeps every block."""
        if sliding_window is not None and (sliding_window < 1 or num_blocks < 2):
            raise ValueError("a sliding window must be >= 1 and leave a block besides NULL_BLOCK")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._num_total = num_blocks
        self.blocks: list[Block] = []  # those ever taken: ids 0 .. len - 1 (see above)
        if sliding_window is not None:  # held for good: never free, never cached
            self.blocks.append(Block(NULL_BLOCK, ref_count=1))
        # The free queue, head first: blocks freed without a hash (the last freed first), the
        # blocks never taken (ids len(blocks) ..), then the LRU of blocks freed with a hash.
        self._free_front: list[int] = []
        self._free_lru: OrderedDict[int, None] = OrderedDict()
        self.num_dropped: dict[int, int] = {}  # seq_id -> leading table entries now NULL_BLOCK
        self.cached: dict[int, int] = {}  # block hash -> block id
        # What `cached` did, for the router's mirror of it. Each change to `cached` is made before
        # its event is logged: `kv_events.take_snapshot` relies on that order.
        self.kv_events = KVEventLog(max_events)
        self.num_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0
        self.working_set = WorkingSet()  # the reuse those lookups ask the cache to hold
        self.num_slots_allocated = 0  # summed over steps: the KV-waste figure
        self.num_slots_used = 0

    @property
    def num_blocks(self) -> int:
        """Blocks sequences can hold (the cache's blocks less NULL_BLOCK, if reserved)."""
        return self._num_total - (self.sliding_window is not None)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_front) + self._num_total - len(self.blocks) + len(self._free_lru)

    def free_block_ids(self) -> list[int]:
        """The free queue, in the order allocations take it (for tests and inspection)."""
        return [*reversed(self._free_front), *range(len(self.blocks), self._num_total),
                *self._free_lru]

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence growing to num_tokens holds at once, if no step computes
        more than max_step_tokens of it: all of them without a window."""
        needed = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return needed
        # The kept blocks start at a block edge at most block_size - 1 tokens before the window
        # of the step's first token, window - 1 tokens before that token.
        span = self.block_size - 1 + self.sliding_window - 1 + max_step_tokens
        return min(needed, self.blocks_needed(span))

    def first_kept_block(self, num_computed_tokens: int) -> int:
        """Index of the oldest block a sequence with this many computed tokens still reads."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    # -- prefix cache -----------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest cached prefix of seq's full blocks: (block ids, number of tokens they hold).

        At least one token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = min((seq.num_tokens - 1) // self.block_size, len(seq.block_hashes))
        if self.sliding_window is not None:
            return self._windowed_hit(seq, max_blocks)
        # Hash lookups, then the token re-check, each in one C-level pass (a 6,000-token prefix
        # is 375 blocks): up to the first miss, then up to the first block whose tokens differ.
        hits = list(map(self.cached.get, islice(seq.block_hashes, max_blocks)))
        if None in hits:
            del hits[hits.index(None):]
        stored = list(map(_token_ids, map(self.blocks.__getitem__, hits)))
        if hits and list(chain.from_iterable(stored)) != seq.prefix_tokens(len(hits)):
            for i, token_ids in enumerate(stored):  # which block differs
                if token_ids != tuple(seq.block_tokens(i)):
                    del hits[i:]
                    break
        return hits, len(hits) * self.block_size

    def _windowed_hit(self, seq: Sequence, max_blocks: int) -> tuple[list[int], int]:
        """The longest prefix whose blocks from first_kept_block(its end) on are all cached,
        searched from the longest down: the older blocks are NULL_BLOCK."""
        end = None  # one past the last block of the current run of cached blocks
        run: list[int] = []  # that run's block ids, last first
        for i in range(max_blocks - 1, -1, -1):
            block_id = self._cached_block(seq, i)
            if block_id is None:
                end, run = None, []
                continue
            if end is None:
                end = i + 1
            run.append(block_id)
            if i <= self.first_kept_block(end * self.block_size):
                return [NULL_BLOCK] * i + run[::-1], end * self.block_size
        return [], 0

    def _cached_block(self, seq: Sequence, i: int) -> int | None:
        """The cached block holding seq's block i, tokens re-checked, or None."""
        block_id = self.cached.get(seq.block_hashes[i])
        if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
            return None
        return block_id

    def record_lookup(self, seq: Sequence, num_hit_tokens: int) -> None:
        """A prompt looked up in the prefix cache (on admission, or readmission after a
        preemption) and how many of its tokens hit."""
        self.num_query_tokens += seq.num_tokens
        self.num_hit_tokens += num_hit_tokens
        if self.enable_prefix_caching:
            self.working_set.touch(islice(seq.block_hashes, seq.num_tokens // self.block_size))

    def record_slot_usage(self, running: list[Sequence]) -> None:
        """Count the slots these sequences hold and the ones holding a token (once per step)."""
        dropped = sum(self.num_dropped.get(s.seq_id, 0) for s in running) if self.num_dropped else 0
        self.num_slots_allocated += (sum(len(s.block_table) for s in running) - dropped) * self.block_size
        self.num_slots_used += sum(s.num_computed_tokens for s in running) - dropped * self.block_size

    @property
    def kv_slot_waste(self) -> float:
        """Fraction of allocated slots, summed over steps, that held no token."""
        if not self.num_slots_allocated:
            return 0.0
        return 1 - self.num_slots_used / self.num_slots_allocated

    def num_evictable_hits(self, block_ids: list[int]) -> int:
        """How many of these hit blocks are now free (taking them shrinks the free pool)."""
        # NULL_BLOCK's ref count is 1: never evictable
        return list(map(_ref_count, map(self.blocks.__getitem__, block_ids))).count(0)

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        total = self._num_tokens_after(seq, num_new_tokens, computed_blocks)
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks)
        return num_new_blocks + self.num_evictable_hits(list(computed_blocks)) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make seq's block table cover its computed tokens, the computed_blocks' tokens and
        num_new_tokens more.

        computed_blocks (from get_computed_blocks, for a newly scheduled seq) are taken first.
        Under a sliding window, the blocks no query of this step or later reads are released
        first. Returns False when the free pool is too small (the caller preempts), having
        changed nothing else. Blocks that will be full after this step are registered in the
        prefix cache now: they are written in this step's forward pass before any attention
        reads them.
        """
        if self.sliding_window is not None:
            self._drop_outside_window(seq, len(computed_blocks))
        elif not computed_blocks:
            # Most decode steps: the tokens fit in the blocks held and fill none to register,
            # so there is nothing to check, take or store (a step of 256 decodes passed each
            # through all of that). _num_tokens_after and _register_full_blocks's count, inline:
            # as method calls they made this hot path markedly slower.
            total = seq.num_computed_tokens + num_new_tokens
            block_size = self.block_size
            if total <= len(seq.block_table) * block_size and (
                    not self.enable_prefix_caching or min(total // block_size, len(seq.block_hashes))
                    <= seq.num_registered_blocks):
                return True
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        total = self._num_tokens_after(seq, num_new_tokens, computed_blocks)
        table = seq.block_table
        if computed_blocks:
            held = computed_blocks
            if self.sliding_window is not None:  # a windowed hit's leading placeholders
                num_null = next((i for i, b in enumerate(held) if b != NULL_BLOCK), len(held))
                if num_null:
                    self.num_dropped[seq.seq_id] = len(table) + num_null
                    held = held[num_null:]
            blocks, free_lru = self.blocks, self._free_lru
            for block_id in held:  # taken: out of the free queue if it was there
                block = blocks[block_id]
                if block.ref_count == 0:  # a hit holds a hash: freed with it, so in the LRU
                    del free_lru[block_id]
                block.ref_count += 1
            table.extend(computed_blocks)
            if len(table) == len(computed_blocks):
                # The hits are the cache's own blocks (or placeholders): nothing to offer it.
                seq.num_registered_blocks = max(seq.num_registered_blocks, len(table))
        evicted: list[int] = []
        num_new = self.blocks_needed(total) - len(table)
        if num_new > 0:
            table += self._take_free(num_new, evicted)
        if evicted:  # one event for all this call evicted: a removal costs a hash, not an event
            self.kv_events.append(BlockRemoved(evicted))
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, total)
        return True

    def free(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they
        # should be evicted first.
        table = seq.block_table
        for block_id in reversed(table[self.num_dropped.pop(seq.seq_id, 0):]):
            self._release(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        self.cached.clear()
        self.kv_events.append(AllBlocksCleared())

    # -- internals --------------------------------------------------------------------------
    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.block_hash is None:  # nothing to keep: reuse it first
                self._free_front.append(block_id)
            else:
                self._free_lru[block_id] = None

    def _drop_outside_window(self, seq: Sequence, num_computed_blocks: int) -> None:
        """Release the blocks of seq's table that its queries from now on never read: those
        wholly before the window of its first token still to compute."""
        computed = seq.num_computed_tokens + num_computed_blocks * self.block_size
        first_kept = min(self.first_kept_block(computed), len(seq.block_table))
        dropped = self.num_dropped.get(seq.seq_id, 0)
        if first_kept <= dropped:
            return
        table = seq.block_table
        # Oldest first, so the free queue evicts dropped blocks in the order they were dropped:
        # a later prefix hit needs the blocks next to its end, the newest ones.
        for i in range(dropped, first_kept):
            self._release(table[i])
            table[i] = NULL_BLOCK
        self.num_dropped[seq.seq_id] = first_kept

    def _num_tokens_after(self, seq: Sequence, num_new_tokens: int, computed_blocks) -> int:
        return seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens

    def _take_free(self, num: int, evicted: list[int]) -> list[int]:
        """The num blocks at the head of the free queue, taken; their cached content (if any)
        evicted (its hashes appended to `evicted`). There must be that many free."""
        blocks = self.blocks
        taken: list[int] = []
        front = self._free_front
        if front:  # freed without a hash: nothing to evict; the last freed first
            taken = front[:-num - 1:-1]
            del front[-num:]
            for block_id in taken:
                blocks[block_id].ref_count = 1
            num -= len(taken)
        if num and len(blocks) < self._num_total:  # never taken before: made now
            start = len(blocks)
            end = min(start + num, self._num_total)
            blocks += map(Block, range(start, end), repeat(1))
            taken += range(start, end)
            num -= end - start
        if num:
            cached, lru = self.cached, self._free_lru
            for _ in range(num):
                block_id, _ = lru.popitem(last=False)
                block = blocks[block_id]
                block.ref_count = 1
                block_hash = block.block_hash
                if block_hash is not None:
                    if cached.get(block_hash) == block_id:
                        del cached[block_hash]
                        evicted.append(block_hash)
                    block.block_hash = None
                    block.token_ids = ()
                taken.append(block_id)
        return taken

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        hashes = seq.block_hashes
        first, num_full = seq.num_registered_blocks, min(num_tokens // self.block_size, len(hashes))
        if first >= num_full:
            return
        blocks, cached, table = self.blocks, self.cached, seq.block_table
        block_tokens = seq.block_tokens
        null = NULL_BLOCK if self.sliding_window is not None else -1  # a dropped block's stand-in
        stored: list[int] = []  # the current run of consecutive blocks stored: one event each run
        for i in range(first, num_full):
            block_id = table[i]
            block = blocks[block_id]
            block_hash = hashes[i]
            # Already cached, the same content already lives elsewhere, or a placeholder: the
            # run breaks.
            if block.block_hash is not None or block_hash in cached or block_id == null:
                if stored:
                    self._log_stored(seq, i - len(stored), stored)
                    stored = []
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(block_tokens(i))
            cached[block_hash] = block_id
            stored.append(block_hash)
        self._log_stored(seq, num_full - len(stored), stored)
        seq.num_registered_blocks = num_full

    def _log_stored(self, seq: Sequence, first: int, block_hashes: list[int]) -> None:
        if block_hashes:
            parent = seq.block_hashes[first - 1] if first else None
            self.kv_events.append(BlockStored(block_hashes, parent))
