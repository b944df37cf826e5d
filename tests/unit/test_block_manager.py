from replicas.block_hash import block_hashes, hash_block, ROOT_HASH
from replicas.block_manager import BlockManager
from replicas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence

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
    assert list(bm.free_queue) == [2, 5, 6, 7, 1, 0]
    assert bm.num_free_blocks == 6


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
    assert list(bm.free_queue) == [2, 3, 1, 0]
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
    bm.record_lookup(10, 0)
    bm.record_lookup(10, 8)
    assert bm.hit_rate == 0.4


def test_stored_events_are_runs_named_by_their_parent():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(range(8))
    admit(bm, a)
    b = seq(list(range(8)) + list(range(20, 29)))  # a's 2 blocks hit, then 2 new full blocks
    admit(bm, b)
    assert bm.kv_events.since(1) == [BlockStored(b.block_hashes[2:], b.block_hashes[1])]


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
