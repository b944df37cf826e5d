import subprocess
import sys

from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.scheduler import Scheduler
from pagedserve.replicas.core.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=64, max_seqs=8, budget=64, max_len=256, chunked=True, caching=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(bm, max_seqs, budget, max_len, chunked), bm


def seq(n_prompt, max_tokens=4, start=0, **kw):
    return Sequence("r", list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw), BS)


def run_to_completion(sched, token=7, max_steps=1000):
    steps = []
    for _ in range(max_steps):
        out = sched.schedule()
        if out.is_empty:
            break
        steps.append([(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled])
        sched.update(out, [[token]] * sum(s.samples for s in out.scheduled))
    return steps


def test_prefill_then_decode_one_token_each():
    sched, bm = make()
    a, b = seq(5), seq(3, start=100)
    sched.add(a), sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        (a, 0, 5, True), (b, 0, 3, True)]
    sched.update(out, [[11], [12]])
    assert a.output_token_ids == [11] and b.output_token_ids == [12]
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(5, 1), (3, 1)]


def test_chunked_prefill_respects_token_budget():
    sched, _ = make(budget=8)
    a = seq(20)
    sched.add(a)
    steps = run_to_completion(sched)
    # 20 prompt tokens in chunks of 8, 8, 4 (sampling on the last), then 3 decodes.
    assert [step[0][1:] for step in steps] == [(0, 8), (8, 8), (16, 4), (20, 1), (21, 1), (22, 1)]
    assert a.status is SequenceStatus.FINISHED_LENGTH and a.num_output_tokens == 4


def test_decodes_and_prefill_chunk_share_a_step():
    sched, _ = make(budget=10)
    a = seq(4)
    sched.add(a)
    sched.update(sched.schedule(), [[1]])
    b = seq(30, start=50)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 9)]


def test_queued_prefill_counts_what_is_left_of_each_prompt_less_its_cache_hit():
    sched, _ = make(budget=8)
    a = seq(20)
    sched.add(a)
    assert sched.queued_prefill_tokens() == 19  # its last token is computed with the first decode
    sched.update(sched.schedule(), [])  # a chunk of 8
    assert sched.queued_prefill_tokens() == 11
    sched.update(sched.schedule(), [])
    sched.update(sched.schedule(), [[5]])  # the last chunk samples the first token
    assert sched.queued_prefill_tokens() == 0  # decoding
    b = seq(12)  # the same first 12 tokens: two of its three full blocks hit the cache...
    sched.add(b)
    assert sched.queued_prefill_tokens() == 11  # ...which waiting, it does not know yet
    sched.update(sched.schedule(), [[5], [5]])  # a decodes; b is admitted, its hit found
    assert b.num_cached_tokens == 8 and sched.queued_prefill_tokens() == 0


def test_without_chunking_a_long_prompt_waits_for_budget():
    sched, _ = make(budget=16, chunked=False, max_len=16)
    a, b = seq(10), seq(10, start=100)
    sched.add(a), sched.add(b)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a]


def test_max_num_seqs():
    sched, _ = make(max_seqs=2)
    seqs = [seq(3, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert sched.num_waiting == 1


def test_preemption_by_recompute_and_no_lost_request():
    # 6 blocks of 4 = 24 slots; three sequences of 6 prompt + 8 output = 14 tokens each cannot
    # all fit, so the youngest is preempted and recomputed later.
    sched, bm = make(num_blocks=6)
    seqs = [seq(6, max_tokens=8, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert all(s.status is SequenceStatus.FINISHED_LENGTH and s.num_output_tokens == 8 for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks
    assert any(s.num_preemptions for s in seqs)


def test_preempted_sequence_resumes_from_its_tokens():
    sched, bm = make(num_blocks=4)
    a, b = seq(4, max_tokens=8), seq(4, max_tokens=8, start=100)
    sched.add(a), sched.add(b)
    run_to_completion(sched)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert a.token_ids[:4] == [0, 1, 2, 3] and b.token_ids[:4] == [100, 101, 102, 103]


def test_prefix_cache_hit_skips_computed_tokens():
    sched, bm = make()
    a = seq(12, max_tokens=1)
    sched.add(a)
    sched.schedule()
    a_blocks = list(a.block_table)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    b = seq(12, max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks hit.
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(8, 4)]
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a_blocks[:2] and len(b.block_table) == 3


def test_stop_conditions():
    sched, _ = make()
    eos = seq(3, max_tokens=10)
    eos.sampling_params.eos_token_ids = {5}
    ignore = seq(3, max_tokens=2, ignore_eos=True, start=10)
    ignore.sampling_params.eos_token_ids = {5}
    stop_id = seq(3, max_tokens=10, stop_token_ids=[5], start=20)
    min_tok = seq(3, max_tokens=10, min_tokens=2, start=30)
    min_tok.sampling_params.eos_token_ids = {5}
    for s in (eos, ignore, stop_id, min_tok):
        sched.add(s)
    run_to_completion(sched, token=5)
    assert eos.status is SequenceStatus.FINISHED_STOPPED and eos.num_output_tokens == 1
    assert ignore.status is SequenceStatus.FINISHED_LENGTH and ignore.num_output_tokens == 2
    assert stop_id.status is SequenceStatus.FINISHED_STOPPED and stop_id.stop_reason == 5
    assert min_tok.num_output_tokens == 2


def test_abort_frees_blocks():
    sched, bm = make()
    a, b = seq(9), seq(9, start=50)
    sched.add(a), sched.add(b)
    sched.update(sched.schedule(), [[1], [1]])
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_unfinished()


def test_control_plane_imports_neither_torch_nor_ray():
    code = ("import sys; import pagedserve.replicas.core.sequence, pagedserve.replicas.core.block_manager, pagedserve.replicas.core.scheduler, "
            "pagedserve.replicas.core.block_hash; bad = [m for m in ('torch', 'ray') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sliding_window_generations_run_in_a_small_pool():
    # Two 300-token generations would need 80 blocks each; with a window of 6 each holds <= 3.
    bm = BlockManager(7, BS, sliding_window=6)  # 6 usable blocks
    sched = Scheduler(bm, 8, 16, 10_000)
    a, b = seq(10, max_tokens=300), seq(7, max_tokens=300, start=50)
    sched.add(a), sched.add(b)
    for _ in range(400):
        out = sched.schedule()
        if out.is_empty:
            break
        for s in (a, b):
            if not s.is_finished:
                assert sum(block != 0 for block in s.block_table) <= bm.max_blocks_held(s.num_tokens, 16)
        sched.update(out, [[7]] * sum(s.samples for s in out.scheduled))
    assert a.num_output_tokens == b.num_output_tokens == 300 and sched.num_preemptions == 0
    assert bm.num_free_blocks == bm.num_blocks and bm.num_dropped == {}


def test_sliding_window_preemption_recomputes_from_scratch():
    bm = BlockManager(5, BS, sliding_window=6)  # 4 usable: two sequences of 3 cannot both fit
    sched = Scheduler(bm, 8, 16, 10_000)
    a, b = seq(3, max_tokens=40), seq(3, max_tokens=40, start=50)  # one block each to start
    sched.add(a), sched.add(b)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert a.num_output_tokens == b.num_output_tokens == 40
    assert bm.num_free_blocks == bm.num_blocks and bm.num_dropped == {}
