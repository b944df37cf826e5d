from pagedserve.replicas.core.block_hash import block_hashes, hash_block, ROOT_HASH
from pagedserve.replicas.core.block_manager import NULL_BLOCK, BlockManager, kv_window_of
from pagedserve.replicas.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.sequence import Sequence

BS = 4


def seq(tokens, n_computed=0):
    s = Sequence("r", list(tokens), SamplingParams(max_tokens=8), BS)
    s.num_computed_tokens = n_computed
    return s


def admit(bm, s):
    blocks, cached = bm.get_computed_blocks(s)
    assert bm.allocate_slots(s, s.num_tokens - cached, blocks)
    s.num_computed_tokens = s.num_tokens
    return cached


def test_hash_chain_is_shared_function():
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 2  # the trailing partial block has no hash
    assert hashes[0] == hash_block(ROOT_HASH, tokens[0:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    assert seq(tokens).block_hashes == hashes


def test_allocate_exact_block_ids_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(range(10))
    assert admit(bm, a) == 0
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    b = seq(range(100, 105))
    admit(bm, b)
    assert b.block_table == [3, 4]
    bm.free(a)
    # The partial (unhashed) block 2 goes to the head for reuse; the full hashed blocks go to the
    # tail, last block first, so a prefix's head outlives its tail.
    assert bm.free_block_ids() == [2, 5, 6, 7, 1, 0]
    assert bm.num_free_blocks == 6


def test_a_block_is_made_when_first_taken():
    # A cache the size of a GPU's (or a thousand simulated replicas' caches) costs nothing to
    # build; blocks are taken in id order as before, and a freed one comes back before the blocks
    # never taken only if it has no hash to keep.
    bm = BlockManager(num_blocks=100_000, block_size=BS)
    assert bm.blocks == [] and bm.num_free_blocks == bm.num_blocks == 100_000
    a, b = seq(range(10)), seq(range(100, 105))
    admit(bm, a)
    admit(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4] and len(bm.blocks) == 5
    bm.free(a)
    assert bm.free_block_ids()[:2] == [2, 5] and bm.free_block_ids()[-2:] == [1, 0]
    assert bm.num_free_blocks == 100_000 - 2


def test_prefix_hit_reuses_blocks_and_rechecks_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(range(12))
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    b = seq(list(range(8)) + [99, 98, 97])
    blocks, cached = bm.get_computed_blocks(b)
    assert blocks == [0, 1] and cached == 8
    # A full hit still leaves the last token to compute: 12 tokens -> at most 2 blocks (8 tokens).
    c = seq(range(12))
    blocks, cached = bm.get_computed_blocks(c)
    assert blocks == [0, 1] and cached == 8
    # Corrupt a block's stored tokens: the hash matches but the re-check refuses it.
    bm.blocks[0].token_ids = (7, 7, 7, 7)
    assert bm.get_computed_blocks(b) == ([], 0)


def test_lru_eviction_order_and_events():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(range(8))  # 2 full blocks
    admit(bm, a)
    bm.free(a)
    assert bm.kv_events.since(0) == [BlockStored(a.block_hashes, None)]  # one run, from the root
    assert bm.free_block_ids() == [2, 3, 1, 0]
    b = seq(range(50, 59))  # needs 3 blocks: takes 2, 3 (never cached) then evicts 1 (a's tail)
    admit(bm, b)
    assert b.block_table == [2, 3, 1]
    assert bm.kv_events.since(1) == [BlockRemoved([a.block_hashes[1]]),
                                     BlockStored(b.block_hashes, None)]
    # a's first block survived eviction and still hits.
    blocks, cached = bm.get_computed_blocks(seq(range(6)))
    assert blocks == [0] and cached == 4


def test_shared_blocks_ref_counted():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = seq(range(9)), seq(range(9))
    admit(bm, a)
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = seq(range(12))
    assert not bm.allocate_slots(a, 12)
    assert a.block_table == [] and bm.num_free_blocks == 2


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = seq(range(12))
    admit(bm, a)
    bm.free(a)
    assert bm.get_computed_blocks(seq(range(12))) == ([], 0)
    assert bm.kv_events.next_seq == 0


def test_hit_rate_counts_lookups():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.record_lookup(seq(range(10)), 0)
    bm.record_lookup(seq(range(10)), 8)
    assert bm.hit_rate == 0.4


def test_lookups_feed_the_reused_working_set():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.record_lookup(seq(range(10)), 0)  # 2 full blocks (BS 4), looked up once: no reuse yet
    assert bm.working_set.measure(0.0) == 0
    bm.record_lookup(seq(range(9)), 8)  # the same 2 blocks again
    assert bm.working_set.measure(1.0) == 2


def test_stored_events_are_runs_named_by_their_parent():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(range(8))
    admit(bm, a)
    b = seq(list(range(8)) + list(range(20, 29)))  # a's 2 blocks hit, then 2 new full blocks
    admit(bm, b)
    assert bm.kv_events.since(1) == [BlockStored(b.block_hashes[2:], b.block_hashes[1])]


def test_decode_steps_take_a_block_when_full_and_register_it_the_step_it_fills():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq(range(6))  # a full block and 2 tokens of the next
    admit(bm, s)
    first_event = bm.kv_events.next_seq

    def decode(token):
        s.append_token(token)
        assert bm.allocate_slots(s, s.num_tokens - s.num_computed_tokens)
        s.num_computed_tokens = s.num_tokens

    decode(50)  # 7 tokens: within the blocks held, none fills
    assert s.block_table == [0, 1] and len(bm.cached) == 1
    assert bm.kv_events.next_seq == first_event
    decode(51)  # 8 tokens: block 1 fills now, and is offered to the cache in this step
    h = s.block_hashes
    assert s.block_table == [0, 1] and bm.cached == {h[0]: 0, h[1]: 1}
    assert bm.kv_events.since(first_event) == [BlockStored([h[1]], h[0])]
    decode(52)  # 9 tokens: a new block
    assert s.block_table == [0, 1, 2] and bm.num_free_blocks == 5


def test_a_block_cached_elsewhere_breaks_a_run():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq(range(13))  # 3 full blocks
    admit(bm, a)
    middle = a.block_table[1]
    bm.free(a)
    # LRU order never evicts a middle block alone (its tail goes first), so drop it by hand.
    del bm.cached[bm.blocks[middle].block_hash]
    bm.blocks[middle].block_hash = None
    b = seq(list(range(13)) + [50, 51, 52, 53])  # hits block 0 only; block 2 lives on in a's copy
    admit(bm, b)
    h = b.block_hashes
    assert bm.kv_events.since(1) == [BlockStored([h[1]], h[0]), BlockStored([h[3]], h[2])]


def test_reset_clears_the_cache_in_one_event():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(range(12))
    admit(bm, a)
    bm.reset_prefix_cache()
    assert bm.cached == {} and all(b.block_hash is None for b in bm.blocks)
    assert bm.kv_events.since(1) == [AllBlocksCleared()]
    assert bm.get_computed_blocks(seq(range(12))) == ([], 0)


def test_the_evictions_of_one_allocation_are_one_event():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(range(16))
    admit(bm, a)
    bm.free(a)  # all four cached, tail first in the LRU queue
    admit(bm, seq(range(50, 59)))  # 3 blocks: evicts a's last three
    h = a.block_hashes
    assert bm.kv_events.since(1)[0] == BlockRemoved([h[3], h[2], h[1]])


# -- sliding windows ----------------------------------------------------------------------------
W = 6  # with BS 4: a query at position p reads p-5..p, so at most 3 blocks (2 when aligned)


def windowed(num_blocks=16, caching=True):
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching, sliding_window=W)


def step(bm, s, num_new=1):
    """One step of seq s: allocate num_new tokens' slots, then count them computed."""
    assert bm.allocate_slots(s, num_new)
    s.num_computed_tokens += num_new
    while s.num_tokens < s.num_computed_tokens + 1:
        s.append_token(200 + s.num_tokens)


def held(bm, s):
    return [b for b in s.block_table if b != NULL_BLOCK]


def test_kv_window_of_layers():
    assert kv_window_of(None) is None and kv_window_of([]) is None
    assert kv_window_of([4096, 4096]) == 4096
    assert kv_window_of([512, 1024]) == 1024  # a block is dropped only once every layer is past it
    assert kv_window_of([4096, None]) is None  # a full-attention layer reads everything


def test_null_block_is_reserved():
    bm = windowed(num_blocks=8)
    assert NULL_BLOCK not in bm.free_block_ids() and bm.num_blocks == 7 == bm.num_free_blocks
    a = seq(range(10))
    admit(bm, a)
    assert a.block_table == [1, 2, 3] and abs(bm.usage - 3 / 7) < 1e-12


def test_blocks_outside_the_window_are_dropped():
    bm = windowed()
    a = seq(range(10))  # positions 0..9 computed
    admit(bm, a)
    step(bm, a)  # computes position 10, which reads 5..10: block 0 (0..3) goes
    assert a.block_table == [NULL_BLOCK, 2, 3]
    assert bm.blocks[1].ref_count == 0 and bm.free_block_ids()[-1] == 1  # cached, at the LRU tail
    assert bm.cached[a.block_hashes[0]] == 1  # still a valid cache entry
    step(bm, a)  # position 11 reads 6..11: block 1 (4..7) stays
    assert a.block_table == [NULL_BLOCK, 2, 3]
    step(bm, a)  # position 12 reads 7..12: still block 1; a new block for 12..15
    step(bm, a)  # position 13 reads 8..13: block 1 goes
    assert a.block_table == [NULL_BLOCK, NULL_BLOCK, 3, 4]
    bm.free(a)
    assert bm.num_free_blocks == bm.num_blocks and NULL_BLOCK not in bm.free_block_ids()
    assert bm.blocks[NULL_BLOCK].ref_count == 1 and bm.blocks[NULL_BLOCK].block_hash is None


def test_a_long_generation_holds_bounded_blocks():
    bm = windowed(num_blocks=5)  # 4 usable blocks: 400 tokens would need 100 without the window
    a = seq(range(7))
    admit(bm, a)
    most = 0
    for _ in range(400):
        step(bm, a)
        most = max(most, len(held(bm, a)))
        assert bm.num_blocks - bm.num_free_blocks == len(held(bm, a))
    assert a.num_computed_tokens == 407 and len(a.block_table) == 102
    assert most <= bm.max_blocks_held(a.num_tokens, 1) == 3
    bm.free(a)
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_drops_as_it_goes():
    bm = windowed(num_blocks=5)
    a = seq(range(40))
    for _ in range(5):
        step(bm, a, 8)  # chunks of 8: computed 8, 16, ...
        assert len(held(bm, a)) <= bm.max_blocks_held(40, 8) == 4
    # The last chunk (32..39) reads from 27 on: blocks 0..5 went, at the start of each step.
    assert a.block_table[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in a.block_table[6:]
    assert len(a.block_table) == 10


def test_max_blocks_held():
    bm, plain = windowed(), BlockManager(16, BS)
    assert plain.max_blocks_held(1000, 1) == 250
    assert bm.max_blocks_held(1000, 1) == 3 and bm.max_blocks_held(1000, 16) == 6
    assert bm.max_blocks_held(5, 16) == 2  # never more than the whole sequence


def test_windowed_hit_needs_only_the_window():
    bm = windowed(num_blocks=32)
    prompt = list(range(21))  # 5 full blocks
    a = seq(prompt)
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    # Evict the prefix's first three blocks: a plain cache would now miss it entirely.
    for i in range(3):
        del bm.cached[a.block_hashes[i]]
    b = seq(prompt)
    blocks, cached = bm.get_computed_blocks(b)
    # 20 tokens hit: the query at 20 reads 15..20, i.e. blocks 3 and 4 only.
    assert cached == 20 and blocks == [NULL_BLOCK] * 3 + table[3:5]
    assert bm.allocate_slots(b, 1, blocks)
    b.num_computed_tokens = 21
    assert b.block_table[:3] == [NULL_BLOCK] * 3 and bm.num_dropped[b.seq_id] == 3
    assert bm.blocks[NULL_BLOCK].block_hash is None and NULL_BLOCK not in bm.free_block_ids()
    step(bm, b)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_hit_must_reach_back_to_the_window():
    bm = windowed(num_blocks=32)
    prompt = list(range(21))
    a = seq(prompt)
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    del bm.cached[a.block_hashes[3]]  # inside the window of position 20
    blocks, cached = bm.get_computed_blocks(seq(prompt))
    # The run 4.. is too short; the longest usable prefix is blocks 0..2 (12 tokens), whose
    # first query (12) reads 7..12: blocks 1 and 2.
    assert cached == 12 and blocks == [NULL_BLOCK, table[1], table[2]]


def test_dropped_then_reused_blocks_never_hit():
    """A sequence's dropped block may be evicted and rewritten by another sequence: the cache
    must then miss it, not hand the new contents to a request with the old prefix."""
    bm = windowed(num_blocks=5)  # 4 usable
    a = seq(range(8))  # blocks 1, 2
    admit(bm, a)
    for _ in range(6):
        step(bm, a)  # position 13 drops block 0 (1) and block 1 (2): both cached and free
    assert a.block_table[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert bm.free_block_ids() == [1, 2]  # a's dropped blocks, still cached
    c = seq(range(100, 107))  # needs two blocks: evicts both and writes its own tokens there
    admit(bm, c)
    assert c.block_table == [1, 2]
    b = seq(list(range(8)) + [5])  # a's prefix: its window at 8 reads 3..8, blocks 0 and 1
    assert bm.get_computed_blocks(b) == ([], 0)


def test_windowed_slot_usage_counts_held_blocks():
    bm = windowed()
    a = seq(range(16))
    admit(bm, a)
    step(bm, a)  # position 16 reads 11..16: blocks 0 and 1 dropped; 2, 3 and a new one held
    bm.record_slot_usage([a])
    assert bm.num_slots_allocated == 3 * BS and bm.num_slots_used == 17 - 2 * BS
