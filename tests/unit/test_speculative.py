"""Speculative decoding's parts alone: prompt lookup, the scheduler's drafts, and the verify
sampler's distribution (a chi-square test against the target's)."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedserve.replicas.config import SpeculativeConfig
from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.scheduler import Scheduler
from pagedserve.replicas.core.sequence import Sequence
from pagedserve.replicas.execution.sampler import Sampler
from pagedserve.replicas.spec.ngram import NgramProposer
from pagedserve.replicas.spec.speculator import Speculator
from pagedserve.replicas.spec.suffix import SuffixProposer


def test_lookup_takes_the_latest_longest_match():
    proposer = NgramProposer(3, 1, 3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert proposer.propose(0, tokens, 10) == [7, 8, 5]  # the latest [1, 2, 3], not the first
    assert proposer.propose(0, tokens + [4], 10) == []  # 4 never came before
    assert proposer.propose(0, tokens + [4, 9], 10) == [1, 2, 3]  # a 1-gram: after its latest
    assert proposer.propose(0, tokens + [4, 9], 1) == [1]  # capped by the room left
    assert NgramProposer(3, 2, 3).propose(1, tokens + [4, 9], 10) == []  # no 2-gram [4, 9]


def test_lookup_skips_hits_across_token_boundaries():
    proposer = NgramProposer(2, 1, 1)
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: a byte search for [1] hits inside 256.
    tokens = [256, 0, 5, 1]
    assert proposer.propose(0, tokens, 4) == []
    assert proposer.propose(1, [1, 6, 256, 0, 1], 4) == [6, 256]


def test_lookup_follows_a_growing_sequence():
    proposer = NgramProposer(2, 1, 2)
    tokens = [5, 6, 7]
    assert proposer.propose(0, tokens, 4) == []
    tokens += [5]
    assert proposer.propose(0, tokens, 4) == [6, 7]
    tokens += [6, 8, 5, 6]
    assert proposer.propose(0, tokens, 4) == [8, 5]
    proposer.release(0)
    assert proposer.propose(0, [1, 1], 4) == [1]


def make_seq(prompt, **params):
    params.setdefault("max_tokens", 100)
    return Sequence("r", list(prompt), SamplingParams(**params), block_size=4)


def test_scheduler_runs_drafts_after_the_last_token_and_rolls_back():
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128)
    seq = make_seq([1, 2, 3, 4, 5])
    scheduler.add(seq)
    out = scheduler.schedule()
    scheduler.update(out, [[6]])
    seq.spec_token_ids = [7, 8, 9]
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert (item.start, item.num_new_tokens, item.spec_token_ids, item.samples) == (5, 4, [7, 8, 9], True)
    assert seq.spec_token_ids == [] and seq.num_computed_tokens == 9
    scheduler.update(out, [[7, 3]])  # one draft accepted, then a different token
    assert seq.token_ids[-3:] == [6, 7, 3] and seq.num_computed_tokens == seq.num_tokens - 1 == 7
    # Drafts get what the step's real tokens leave of the budget: here another's prefill.
    other = make_seq(list(range(20, 26)))
    scheduler.add(other)
    seq.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == [seq, other]
    assert out.scheduled[0].spec_token_ids == [1] and out.num_batched_tokens == 8


def test_drafts_take_only_what_real_tokens_leave():
    """Another sequence's decode token and its blocks come before any draft."""
    bm = BlockManager(4, 4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    a, b = make_seq([1, 2, 3, 4]), make_seq([5, 6, 7, 8])
    for seq in (a, b):
        scheduler.add(seq)
    scheduler.update(scheduler.schedule(), [[9], [9]])  # two blocks held, two free
    a.spec_token_ids = list(range(20, 28))
    out = scheduler.schedule()  # each decode takes a block: none is left for drafts
    assert [s.seq for s in out.scheduled] == [a, b] and not out.preempted
    assert out.scheduled[0].spec_token_ids == [20, 21, 22]  # only its new block's room
    assert a.spec_token_ids == []


def test_speculator_leaves_room_for_the_last_token_and_backs_off():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    speculator = Speculator(config, max_model_len=64)
    seq = make_seq([1, 2, 3, 1, 2, 3, 1], max_tokens=3)
    seq.num_computed_tokens = seq.num_tokens - 1
    speculator.propose([seq])
    assert seq.spec_token_ids == [2, 3]  # max_tokens 3: two drafts and the token after them
    speculator.record(seq, 2, 0)  # all missed: no drafts next step, then again
    speculator.propose([seq])
    assert seq.spec_token_ids == []
    speculator.propose([seq])
    assert seq.spec_token_ids == [2, 3]
    speculator.record(seq, 2, 0)  # missed again: the wait doubles
    for _ in range(2):
        speculator.propose([seq])
        assert seq.spec_token_ids == []
    speculator.propose([seq])
    assert seq.spec_token_ids == [2, 3]
    speculator.record(seq, 2, 1)
    speculator.propose([seq])
    assert seq.spec_token_ids == [2, 3]
    stats = speculator.stats()
    assert stats["spec_decode_num_drafts"] == 3 and stats["spec_decode_num_accepted_tokens"] == 1
    assert stats["spec_decode_accepted_per_position"] == [1, 0, 0, 0]
    assert stats["spec_decode_mean_accepted_length"] == pytest.approx(1 + 1 / 3)


def test_verify_keeps_the_target_distribution():
    """With a draft of probability 0.3 at position 0: the first token follows the target
    distribution exactly (kept with its probability, otherwise drawn from the rest), and the
    second, after an accepted draft, follows position 1's."""
    probs = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1, 0.0], [0.05, 0.05, 0.1, 0.2, 0.3, 0.3]],
                         dtype=torch.float64)
    logits = probs.clamp_min(1e-12).log().float()
    sampler = Sampler(6)
    seq = make_seq([1, 2, 3], temperature=1.0)
    firsts, seconds = np.zeros(6), np.zeros(6)
    draws = 6000
    for _ in range(draws):
        (tokens,), _ = sampler.verify(logits.clone(), [seq], [[0]])
        firsts[tokens[0]] += 1
        if tokens[0] == 0:
            assert len(tokens) == 2
            seconds[tokens[1]] += 1
        else:
            assert len(tokens) == 1
    assert chisquare(firsts[:5], probs[0, :5].numpy() / probs[0, :5].sum().item() * draws).pvalue > 1e-3
    assert firsts[5] == 0
    assert chisquare(seconds, probs[1].numpy() / probs[1].sum().item() * seconds.sum()).pvalue > 1e-3


def test_verify_with_a_seed_draws_as_plain_steps_do():
    """A seeded sequence gets the tokens one plain step per token would give it, however many
    of its drafts were right, and its generator ends where those steps leave it."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    plain_sampler, spec_sampler = Sampler(50), Sampler(50)
    plain_seq = make_seq([1], temperature=1.0, seed=42)
    spec_seq = make_seq([1], temperature=1.0, seed=42)
    plain = [plain_sampler(logits[i:i + 1].clone(), [plain_seq]).sampled_token_ids[0]
             for i in range(3)]
    drafts = [plain[0], plain[1], (plain[2] + 1) % 50]  # the third draft is wrong
    (tokens,), _ = spec_sampler.verify(logits.clone(), [spec_seq], [drafts])
    assert tokens == plain[:3]
    nxt = plain_sampler(logits[3:4].clone(), [plain_seq]).sampled_token_ids
    assert spec_sampler(logits[3:4].clone(), [spec_seq]).sampled_token_ids == nxt


def test_the_acceptance_a_draft_needs_follows_the_measured_step_cost():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    speculator = Speculator(config, max_model_len=64)
    assert speculator.min_acceptance(1) == 0.0  # before any timing: free at small batches
    assert speculator.min_acceptance(8) == 0.5
    for _ in range(200):  # a one-row step takes 10 ms, each further row 1 ms
        speculator.observe_step(0.018, 9, light_s=0.010)
    assert speculator.min_acceptance(1) == pytest.approx(1 / 10)  # a row over a token's share
    assert speculator.min_acceptance(32) == pytest.approx(32 / 41)


def test_under_load_drafts_shrink_and_stop_with_the_acceptance():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    speculator = Speculator(config, max_model_len=256)
    for _ in range(50):
        speculator.observe_step(0.018, 9, light_s=0.010)  # at 8 running, a draft needs 8/17
    batch = [make_seq([5, 6, 7, 8, 9, 10, 0, 5, 6], max_tokens=100) for _ in range(8)]
    for seq in batch:
        seq.num_computed_tokens = seq.num_tokens - 1
    speculator.propose(batch)
    seq = batch[0]
    assert seq.spec_token_ids == [7, 8, 9, 10]  # a new sequence starts from the engine's rate
    speculator.record(seq, 4, 1)  # rate 1 -> 0.775: still pays, fewer drafts
    speculator.propose(batch)
    assert seq.spec_token_ids == [7, 8, 9]
    speculator.record(seq, 3, 0)
    speculator.record(seq, 3, 0)
    speculator.record(seq, 3, 1)  # rate below 8/17 though one was accepted: it waits
    speculator.propose(batch)
    assert seq.spec_token_ids == []
    assert batch[1].spec_token_ids  # the others are judged on their own rates


def finished(proposer, seq_id, prompt, output):
    """A request seen running, then ended: its output stays in the proposer's cache."""
    proposer.propose(seq_id, prompt + output, 0, len(prompt))
    proposer.release(seq_id)


def test_suffix_drafts_come_from_earlier_requests_outputs():
    proposer = SuffixProposer(8, max_depth=24, max_cached=10, max_spec_factor=1.0,
                              min_token_prob=0.1)
    finished(proposer, 1, [1, 2, 3], [10, 11, 12, 13, 14, 15, 16])
    # Another request whose prompt never held those tokens: a two-token match earns two drafts,
    # a four-token match four.
    assert proposer.propose(2, [7, 8, 10, 11], 8, 4) == [12, 13]
    assert proposer.propose(3, [7, 10, 11, 12, 13], 8, 5) == [14, 15, 16]  # all that follows
    assert proposer.propose(4, [9, 8, 7], 8, 3) == []  # no match anywhere
    # Its own prompt counts too, and its own output as it grows.
    assert proposer.propose(5, [20, 21, 22, 23, 24, 20, 21, 22], 8, 8) == [23, 24, 20]


def test_suffix_follows_the_most_common_continuation_while_it_is_likely():
    proposer = SuffixProposer(8, max_depth=24, max_cached=10, max_spec_factor=4.0,
                              min_token_prob=0.5)
    for seq_id, tail in ((1, [1, 2, 3]), (2, [1, 2, 4]), (3, [9, 9, 9])):
        finished(proposer, seq_id, [0], [5, 6, *tail])
    # After 5 6: 1 in two of three (2/3), then 2 in both (2/3), then 3 or 4 (1/3: below 0.5).
    assert proposer.propose(4, [0, 5, 6], 8, 3) == [1, 2]


def test_suffix_cache_keeps_the_latest_outputs_and_running_ones():
    proposer = SuffixProposer(4, max_depth=24, max_cached=3, max_spec_factor=2.0,
                              min_token_prob=0.1)
    proposer.propose(9, [50, 60, 70, 80], 0, 1)  # running: never dropped
    for seq_id in (1, 2, 3):
        finished(proposer, seq_id, [0], [seq_id, 100 + seq_id, 200 + seq_id])
    # Three requests' outputs are kept, this one's among them: 1 and 2 are gone by now.
    assert proposer.propose(4, [0, 3, 103], 4, 3) == [203]
    assert proposer.propose(5, [0, 1, 101], 4, 3) == []
    assert proposer.propose(6, [0, 60, 70], 4, 3) == [80]  # the running one's output
    # The outputs kept are those that ended last, whatever order they began in.
    proposer = SuffixProposer(4, max_depth=24, max_cached=3, max_spec_factor=2.0,
                              min_token_prob=0.1)
    for seq_id in (1, 2):
        proposer.propose(seq_id, [0, seq_id, 100 + seq_id, 200 + seq_id], 0, 1)
    proposer.release(2, [0, 2, 102, 202], 1)
    proposer.release(1, [0, 1, 101, 201], 1)
    finished(proposer, 3, [0], [3, 103, 203])
    assert proposer.propose(4, [0, 1, 101], 4, 3) == [201]
    # A request that ended without ever being drafted for leaves its whole output too.
    proposer = SuffixProposer(4, max_depth=24, max_cached=3, max_spec_factor=2.0,
                              min_token_prob=0.1)
    proposer.release(7, [0, 41, 42, 43, 44], 1)
    assert proposer.propose(8, [0, 41, 42], 4, 3) == [43, 44]
