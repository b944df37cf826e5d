"""Paged KV-cache bookkeeping: block ids, ref counts, and the hash-chained prefix cache.

Pure Python. A block is free when its ref count is 0; free blocks sit in an LRU queue and keep
their hash, so a later request with the same prefix can take them back (a prefix-cache hit)
until an allocation evicts them from the head of the queue.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from replicas.kv_events import (DEFAULT_LOG_CAPACITY, AllBlocksCleared, BlockRemoved, BlockStored,
                                KVEventLog)
from replicas.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept to re-check a hash hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_events: int = DEFAULT_LOG_CAPACITY):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        # What `cached` did, for the router's mirror of it. Each change to `cached` is made before
        # its event is logged: `kv_events.take_snapshot` relies on that order.
        self.kv_events = KVEventLog(max_events)
        self.num_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0
        self.num_slots_allocated = 0  # summed over steps: the KV-waste figure
        self.num_slots_used = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest cached prefix of seq's full blocks: (block ids, number of tokens they hold).

        At least one token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for i, block_hash in enumerate(seq.block_hashes[:max_blocks]):
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def record_slot_usage(self, running: list[Sequence]) -> None:
        """Count the slots these sequences hold and the ones holding a token (once per step)."""
        self.num_slots_allocated += sum(len(s.block_table) for s in running) * self.block_size
        self.num_slots_used += sum(s.num_computed_tokens for s in running)

    @property
    def kv_slot_waste(self) -> float:
        """Fraction of allocated slots, summed over steps, that held no token."""
        if not self.num_slots_allocated:
            return 0.0
        return 1 - self.num_slots_used / self.num_slots_allocated

    def num_evictable_hits(self, block_ids: list[int]) -> int:
        """How many of these hit blocks are now free (taking them shrinks the free pool)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        total = self._num_tokens_after(seq, num_new_tokens, computed_blocks)
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks)
        return num_new_blocks + self.num_evictable_hits(list(computed_blocks)) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make seq's block table cover its computed tokens, the computed_blocks' tokens and
        num_new_tokens more.

        computed_blocks (from get_computed_blocks, for a newly scheduled seq) are taken first.
        Returns False, changing nothing, when the free pool is too small (the caller preempts).
        Blocks that will be full after this step are registered in the prefix cache now: they are
        written in this step's forward pass before any attention reads them.
        """
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        total = self._num_tokens_after(seq, num_new_tokens, computed_blocks)
        for block_id in computed_blocks:
            self._take(block_id)
            seq.block_table.append(block_id)
        evicted: list[int] = []
        while len(seq.block_table) < self.blocks_needed(total):
            block_id = self._pop_free(evicted)
            self._take(block_id)
            seq.block_table.append(block_id)
        if evicted:  # one event for all this call evicted: a removal costs a hash, not an event
            self.kv_events.append(BlockRemoved(evicted))
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, total)
        return True

    def free(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they
        # should be evicted first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:  # nothing to keep: reuse it first
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        self.cached.clear()
        self.kv_events.append(AllBlocksCleared())

    # -- internals --------------------------------------------------------------------------
    def _num_tokens_after(self, seq: Sequence, num_new_tokens: int, computed_blocks) -> int:
        return seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _pop_free(self, evicted: list[int]) -> int:
        block_id = next(iter(self.free_queue))  # LRU head; _take removes it
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                evicted.append(block.block_hash)
            block.block_hash = None
            block.token_ids = ()
        return block_id

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        num_full = min(num_tokens // self.block_size, len(seq.block_hashes))
        stored: list[int] = []  # the current run of consecutive blocks stored: one event each run
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            # Already cached, or the same content already lives elsewhere: the run breaks.
            if block.block_hash is not None or block_hash in self.cached:
                self._log_stored(seq, i - len(stored), stored)
                stored = []
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(seq.block_tokens(i))
            self.cached[block_hash] = block.block_id
            stored.append(block_hash)
        self._log_stored(seq, num_full - len(stored), stored)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def _log_stored(self, seq: Sequence, first: int, block_hashes: list[int]) -> None:
        if block_hashes:
            parent = seq.block_hashes[first - 1] if first else None
            self.kv_events.append(BlockStored(block_hashes, parent))
