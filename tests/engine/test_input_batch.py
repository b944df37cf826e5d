"""InputBatch against a token-by-token reference (AttentionMetadata.build and plain lists), over
mixed batches: prefill chunks, decodes, prefix-cache hits, joins, leaves and preemption."""
import random

import pytest
import torch

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve import LLM, SamplingParams
from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.execution.input_batch import InputBatch
from pagedserve.replicas.core.scheduler import ScheduledSeq, Scheduler
from pagedserve.replicas.core.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def make_seq(num_tokens: int, block_table: list[int], max_tokens: int = 100) -> Sequence:
    seq = Sequence("r", list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=max_tokens),
                   BLOCK_SIZE)
    seq.block_table = list(block_table)
    seq.status = SequenceStatus.RUNNING
    return seq


def check_step(batch: InputBatch, scheduled: list[ScheduledSeq]) -> None:
    """prepare() equals the reference built token by token from the same schedule."""
    step = batch.prepare(scheduled)
    expected = AttentionMetadata.build([s.num_new_tokens for s in scheduled],
                                       [s.start + s.num_new_tokens for s in scheduled],
                                       [list(s.seq.block_table) for s in scheduled], BLOCK_SIZE)
    got = step.metadata
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        actual, want = getattr(got, name), getattr(expected, name)
        assert actual.dtype == want.dtype and actual.is_contiguous(), name
        assert actual.tolist() == want.tolist(), name
    assert got.query_lens_cpu == expected.query_lens_cpu
    assert got.seq_lens_cpu == expected.seq_lens_cpu
    ids, positions, logits_rows, row = [], [], [], 0
    for s in scheduled:
        end = s.start + s.num_new_tokens
        ids += s.seq.token_ids[s.start:end]
        positions += range(s.start, end)
        row += s.num_new_tokens
        if s.samples:
            logits_rows.append(row - 1)
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == positions
    assert step.logits_indices.tolist() == logits_rows
    assert step.sampling_seqs == [s.seq for s in scheduled if s.samples]


def test_mixed_batch_over_steps():
    batch = InputBatch(max_num_seqs=4, max_num_batched_tokens=64, max_blocks_per_seq=8,
                       block_size=BLOCK_SIZE, device=CPU)
    decode = make_seq(9, [7, 3, 11])  # 8 tokens cached: decodes position 8
    prefill = make_seq(10, [0, 1])  # first chunk of a 10-token prompt
    hit = make_seq(7, [5, 9])  # prefix-cache hit: 4 tokens cached, computes 3
    check_step(batch, [ScheduledSeq(decode, 8, 1), ScheduledSeq(prefill, 0, 6),
                       ScheduledSeq(hit, 4, 3)])
    assert batch.row_of == {decode.seq_id: 0, prefill.seq_id: 1, hit.seq_id: 2}

    decode.token_ids.append(1)  # crosses into a new block
    decode.block_table.append(2)
    prefill.block_table.append(4)  # the rest of the prompt
    hit.token_ids.append(2)
    batch.release(hit.seq_id)  # finished
    joined = make_seq(3, [6])
    check_step(batch, [ScheduledSeq(decode, 9, 1), ScheduledSeq(prefill, 6, 4),
                       ScheduledSeq(joined, 0, 3)])
    assert batch.row_of[joined.seq_id] == 2  # the freed row, reused
    assert batch.block_table[0, :4].tolist() == [7, 3, 11, 2]

    # Preempted: its blocks are freed (a new, empty list) and it comes back with other blocks.
    batch.release(prefill.seq_id)
    prefill.block_table = [12, 13, 14]
    decode.token_ids.append(3)
    check_step(batch, [ScheduledSeq(prefill, 0, 10), ScheduledSeq(decode, 10, 1)])
    assert batch.row_of[prefill.seq_id] == 1


def test_replaced_table_is_rewritten_without_release():
    """A preemption the runner was not told about still rewrites the row (the list changed)."""
    batch = InputBatch(2, 16, 8, BLOCK_SIZE, CPU)
    seq = make_seq(9, [1, 2, 3])
    check_step(batch, [ScheduledSeq(seq, 0, 9)])
    seq.block_table = [4]
    check_step(batch, [ScheduledSeq(seq, 0, 4)])
    assert batch.block_table[0].tolist() == [4, 0, 0, 0, 0, 0, 0, 0]


def test_only_new_blocks_are_written():
    batch = InputBatch(2, 16, 8, BLOCK_SIZE, CPU)
    seq = make_seq(5, [3, 4])
    check_step(batch, [ScheduledSeq(seq, 0, 5)])
    batch.block_table[0, :2] = -1  # were these entries rewritten, the next steps would show it
    seq.token_ids.append(1)
    assert batch.prepare([ScheduledSeq(seq, 5, 1)]).metadata.block_tables.tolist() == [[-1, -1]]
    seq.block_table.append(8)
    assert batch.prepare([ScheduledSeq(seq, 5, 1)]).metadata.block_tables.tolist() == [[-1, -1, 8]]


def test_rows_of_unreleased_finished_seqs_are_reclaimed():
    batch = InputBatch(2, 16, 8, BLOCK_SIZE, CPU)
    first, second, third = make_seq(2, [0]), make_seq(2, [1]), make_seq(2, [2])
    check_step(batch, [ScheduledSeq(first, 0, 2), ScheduledSeq(second, 0, 2)])
    first.status = SequenceStatus.FINISHED_STOPPED
    check_step(batch, [ScheduledSeq(second, 1, 1), ScheduledSeq(third, 0, 2)])
    assert batch.row_of == {second.seq_id: 1, third.seq_id: 0}
    fourth = make_seq(2, [3])
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        batch.prepare([ScheduledSeq(fourth, 0, 2)])


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_driven_steps_match_reference(seed):
    """Random arrivals, shared prefixes, a small pool (preemptions), chunked prefill, aborts."""
    rng = random.Random(seed)
    max_num_seqs, num_blocks = 6, 16
    block_manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    scheduler = Scheduler(block_manager, max_num_seqs, max_num_batched_tokens=24, max_model_len=60)
    batch = InputBatch(max_num_seqs, 24, num_blocks, BLOCK_SIZE, CPU)
    prefix = [rng.randrange(100) for _ in range(12)]
    num_hits = 0
    for step in range(150):
        if step < 100 and rng.random() < 0.3:
            prompt = (prefix[:rng.choice([4, 8, 12])] if rng.random() < 0.5 else [])
            prompt = prompt + [rng.randrange(100) for _ in range(rng.randint(1, 14))]
            scheduler.add(Sequence("r", prompt, SamplingParams(max_tokens=rng.randint(1, 30)),
                                   BLOCK_SIZE))
        out = scheduler.schedule()
        for seq in out.preempted:
            batch.release(seq.seq_id)
        num_hits += sum(1 for s in out.scheduled if s.start > 0 and s.num_new_tokens > 1)
        if out.is_empty:
            continue
        check_step(batch, out.scheduled)
        sampling = [s.seq for s in out.scheduled if s.samples]
        scheduler.update(out, [[rng.randrange(100)] for _ in sampling])
        if scheduler.running and rng.random() < 0.05:
            sampling.append(rng.choice(scheduler.running))
            scheduler.finish(sampling[-1], SequenceStatus.FINISHED_ABORTED)
        for seq in sampling:
            if seq.is_finished:
                batch.release(seq.seq_id)
        assert set(batch.row_of) <= {s.seq_id for s in scheduler.running}
    assert scheduler.num_preemptions > 0 and num_hits > 0, (scheduler.num_preemptions, num_hits)


def test_runner_frees_rows(tiny_model_dir):
    """Through the engine, with preemptions: every row is back once every request is done."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=12, block_size=4, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 9, 14, 3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.input_batch.row_of == {}
    assert engine.runner.input_batch.num_free_rows == engine.config.max_num_seqs
