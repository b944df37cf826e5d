import math
import random

import numpy as np
import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.replicas.execution import logprobs as logprobs_module
from pagedserve.replicas.execution.logprobs import compute_prompt_logprobs
from pagedserve.replicas.execution.penalties import (
    apply_logit_bias, apply_min_tokens, apply_penalties,
)
from pagedserve.replicas.execution import sampler as sampler_module
from pagedserve.replicas.execution.sampler import Sampler, apply_min_p, apply_top_k_top_p
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.sequence import Sequence

V = 8
NEG_INF = float("-inf")


def make_seq(prompt=(1, 2, 3), output=(), eos_token_id=None, index=0, **params) -> Sequence:
    params.setdefault("max_tokens", 1000)
    seq = Sequence("req", list(prompt), SamplingParams(**params), block_size=4, index=index,
                   eos_token_id=eos_token_id)
    for token_id in output:
        seq.append_token(token_id)
    return seq


def random_logits(num_rows: int, vocab_size: int = V, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 3


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in logits]


# ---- greedy ----------------------------------------------------------------------------------

def test_greedy_fast_path_is_argmax():
    logits = random_logits(5, 50)
    seqs = [make_seq(temperature=0.0) for _ in range(5)]
    out = Sampler(50)(logits.clone(), seqs)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = random_logits(4, 50)
    seqs = [make_seq(temperature=0.0), make_seq(temperature=1.0, seed=3),
            make_seq(temperature=0.0, logprobs=2), make_seq(temperature=0.7)]
    out = Sampler(50)(logits.clone(), seqs)
    expected = logits.argmax(dim=-1).tolist()
    assert out.sampled_token_ids[0] == expected[0]
    assert out.sampled_token_ids[2] == expected[2]


def test_greedy_picks_argmax_of_penalised_logits():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    seq = make_seq(prompt=[0], output=[1, 1], temperature=0.0, frequency_penalty=1.0)
    assert Sampler(V)(logits, [seq]).sampled_token_ids == [2]  # 5 - 2 × 1.0 < 4


# ---- penalties, bias, min_tokens (exact, against a numpy reference) --------------------------

def reference_penalties(logits, prompt, output, repetition, presence, frequency):
    x = logits.astype(np.float32).copy()
    seen = np.zeros(x.shape, bool)
    seen[list(prompt) + list(output)] = True
    counts = np.zeros(x.shape, np.float32)
    for t in output:
        counts[t] += 1
    rep = np.float32(repetition)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x).astype(np.float32)
    x = (x - np.float32(frequency) * counts).astype(np.float32)
    x = (x - np.float32(presence) * (counts > 0).astype(np.float32)).astype(np.float32)
    return x


@pytest.mark.parametrize("repetition,presence,frequency",
                         [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.8),
                          (1.5, -0.4, 1.2), (1.2, 2.0, -2.0)])
def test_penalties_match_reference_exactly(repetition, presence, frequency):
    logits = random_logits(3)
    prompts = [[1, 2, 2], [0, 7], [5]]
    outputs = [[2, 3, 3, 5], [], [5, 5, 6, 1, 5]]
    seqs = [make_seq(prompt=p, output=o, repetition_penalty=repetition,
                     presence_penalty=presence, frequency_penalty=frequency)
            for p, o in zip(prompts, outputs)]
    got = logits.clone()
    apply_penalties(got, seqs)
    for i in range(3):
        expected = reference_penalties(logits[i].numpy(), prompts[i], outputs[i], repetition,
                                       presence, frequency)
        np.testing.assert_array_equal(got[i].numpy(), expected)


def test_penalties_ignore_ids_outside_the_vocabulary():
    """A tokenizer may know more ids than the model has logits (padded vocabularies, the other
    way round): those take no part, and a row with only such ids is left as it is."""
    logits = random_logits(2)
    seqs = [make_seq(prompt=[V + 2], output=[V, 3, V + 1, 3], repetition_penalty=2.0, frequency_penalty=0.5),
            make_seq(prompt=[V + 5], output=[V + 5], repetition_penalty=2.0, presence_penalty=1.0)]
    got = logits.clone()
    apply_penalties(got, seqs)
    expected = reference_penalties(logits[0].numpy(), [], [3, 3], 2.0, 0.0, 0.5)
    np.testing.assert_array_equal(got[0].numpy(), expected)
    assert torch.equal(got[1], logits[1])


def test_penalties_touch_only_rows_that_ask():
    logits = random_logits(3)
    seqs = [make_seq(output=[4]), make_seq(output=[4, 4], presence_penalty=1.0),
            make_seq(output=[4])]
    got = logits.clone()
    apply_penalties(got, seqs)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    expected = logits[1].clone()
    expected[4] -= 1.0
    assert torch.equal(got[1], expected)


def test_penalised_row_is_the_same_alone_and_in_any_batch():
    logits = random_logits(3)
    make = [lambda: make_seq(output=[4, 4, 6], repetition_penalty=1.4),
            lambda: make_seq(output=[4, 1], presence_penalty=0.9),
            lambda: make_seq(output=[2, 2, 2], frequency_penalty=-0.3)]
    batched = logits.clone()
    apply_penalties(batched, [m() for m in make])
    for i, m in enumerate(make):
        alone = logits[i:i + 1].clone()
        apply_penalties(alone, [m()])
        assert torch.equal(alone[0], batched[i])


def test_logit_bias_adds_exactly():
    logits = random_logits(2)
    seqs = [make_seq(logit_bias={3: 2.5, 0: -100.0, 99: 5.0}), make_seq()]
    got = logits.clone()
    apply_logit_bias(got, seqs)
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 0] += -100.0
    assert torch.equal(got, expected)


def test_logit_bias_steers_greedy():
    logits = torch.zeros(1, V)
    logits[0, 2] = 1.0
    seq = make_seq(temperature=0.0, logit_bias={6: 3.0})
    assert Sampler(V)(logits, [seq]).sampled_token_ids == [6]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(4, V)
    seqs = [
        make_seq(output=[1], eos_token_id=7, min_tokens=2, stop_token_ids=[5]),
        make_seq(output=[1, 1], eos_token_id=7, min_tokens=2, stop_token_ids=[5]),  # reached
        make_seq(output=[], eos_token_id=7, min_tokens=1, ignore_eos=True, stop_token_ids=[5]),
        make_seq(output=[], eos_token_id=7, min_tokens=1),
    ]
    seqs[2].sampling_params.eos_token_ids = {6, 7}
    seqs[3].sampling_params.eos_token_ids = {6, 7}
    apply_min_tokens(logits, seqs)
    assert kept(logits) == [set(range(V)) - {5, 7}, set(range(V)), set(range(V)) - {5},
                            set(range(V)) - {6, 7}]


def test_min_tokens_keeps_greedy_off_eos():
    logits = torch.zeros(1, V)
    logits[0, 7] = 10.0
    logits[0, 3] = 1.0
    seq = make_seq(temperature=0.0, eos_token_id=7, min_tokens=1)
    assert Sampler(V)(logits, [seq]).sampled_token_ids == [3]


# ---- truncation: top_k, top_p, min_p --------------------------------------------------------

PROBS = [0.05, 0.4, 0.1, 0.3, 0.15]


@pytest.mark.parametrize("params,expected", [
    (dict(top_k=2), {1, 3}),
    (dict(top_k=5), {0, 1, 2, 3, 4}),
    (dict(top_p=0.8), {1, 3, 4}),
    (dict(top_p=0.5), {1, 3}),
    (dict(top_p=0.3), {1}),
    (dict(top_k=3, top_p=0.6), {1, 3}),
    (dict(top_k=1, top_p=0.99), {1}),
])
def test_top_k_top_p_mask_exactly(params, expected):
    logits = torch.tensor([PROBS]).log()
    apply_top_k_top_p(logits, [make_seq(**params)])
    assert kept(logits) == [expected]


@pytest.mark.parametrize("min_p,expected", [(0.5, {1, 3}), (0.3, {1, 3, 4}), (0.9, {1}),
                                            (0.1, {0, 1, 2, 3, 4})])
def test_min_p_masks_exactly(min_p, expected):
    logits = torch.tensor([PROBS]).log()
    apply_min_p(logits, [make_seq(min_p=min_p)])
    assert kept(logits) == [expected]


def test_top_k_keeps_ties_and_leaves_other_rows_alone():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0],
                           [0.5, 0.1, 0.2, 0.3, 0.4]])
    original = logits.clone()
    apply_top_k_top_p(logits, [make_seq(top_k=2), make_seq(), make_seq(top_p=0.5)])
    assert kept(logits)[0] == {1, 2, 3}
    assert torch.equal(logits[1], original[1])
    assert torch.equal(logits[0, [1, 2, 3]], original[0, [1, 2, 3]])


@pytest.mark.parametrize("candidates", [(256,), (16,), (16, 64), (16, 300, 1000), (2000,)], ids=str)
def test_top_p_from_candidates_equals_full_sort(monkeypatch, candidates):
    """Every tier of candidates decides what it can; the rest go to the next tier, then the sort."""
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", candidates)
    generator = torch.Generator().manual_seed(3)
    scales = torch.tensor([0.01, 0.3, 1.0, 3.0, 8.0, 20.0] * 4)[:, None]
    logits = torch.randn(24, 1000, generator=generator) * scales
    logits[5, :40] = 100.0  # a tie at the k-th value running past the candidates
    k = torch.tensor([1000, 5, 1000, 50, 300, 20, 1000, 1, 2, 1000, 17, 1000] * 2)
    p = torch.tensor([0.9, 0.5, 0.99, 0.3, 0.95, 0.66, 0.1, 0.8, 0.6, 0.75, 0.2, 0.97] * 2)
    fast = sampler_module._top_k_top_p(logits.clone(), k, p)
    reference = sampler_module._top_k_top_p_sorted(logits.clone(), k, p)
    fast_kept, reference_kept = kept(fast), kept(reference)
    # Among equal logits which ones top_p keeps is arbitrary (vLLM's too): compare row 5 by count.
    assert len(fast_kept[5]) == len(reference_kept[5]) == 27
    assert fast_kept[:5] + fast_kept[6:] == reference_kept[:5] + reference_kept[6:]
    assert torch.equal(fast[fast > NEG_INF], logits[fast > NEG_INF])


def test_truncation_limits_what_is_sampled():
    logits = torch.tensor([PROBS] * 400).log()
    seqs = [make_seq(top_k=2) for _ in range(200)] + [make_seq(min_p=0.3) for _ in range(200)]
    torch.manual_seed(0)
    sampled = Sampler(5)(logits, seqs).sampled_token_ids
    assert set(sampled[:200]) == {1, 3}
    assert set(sampled[200:]) == {1, 3, 4}


# ---- random sampling: seeds, noise, distribution --------------------------------------------

def run_steps(sampler, batch_fn, target, num_steps):
    """Sample `num_steps` tokens for `target` in batches built by batch_fn(step) -> other seqs."""
    for step in range(num_steps):
        others = batch_fn(step)
        seqs = others + [target]
        random.Random(step).shuffle(seqs)
        logits = torch.stack([random_logits(1, 64, seed=1000 * step + s.num_tokens)[0]
                              if s is not target else random_logits(1, 64, seed=step)[0]
                              for s in seqs])
        out = sampler(logits, seqs)
        for seq, token_id in zip(seqs, out.sampled_token_ids):
            seq.append_token(token_id)
    return target.output_token_ids


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
                                    dict(temperature=1.3, top_k=10, min_p=0.05)])
def test_seeded_tokens_do_not_depend_on_the_batch(params):
    alone = run_steps(Sampler(64), lambda step: [], make_seq(seed=42, **params), 30)

    def crowd(step):
        kinds = [dict(temperature=1.0), dict(temperature=0.0), dict(seed=step, top_p=0.5),
                 dict(temperature=0.5, top_k=3, logprobs=2), dict(repetition_penalty=1.2, seed=1)]
        return [make_seq(**kinds[(step + j) % len(kinds)]) for j in range(step % 4 + 1)]

    batched = run_steps(Sampler(64), crowd, make_seq(seed=42, **params), 30)
    assert alone == batched
    other_sample = run_steps(Sampler(64), lambda step: [], make_seq(seed=42, index=1, **params), 30)
    assert other_sample != alone  # sample_seed = seed + index


def test_release_forgets_the_generator():
    sampler = Sampler(64)
    seq = make_seq(seed=7)
    logits = torch.zeros(1, 64)
    first = [sampler(logits.clone(), [seq]).sampled_token_ids[0] for _ in range(10)]
    sampler.release(seq.seq_id)
    again = [sampler(logits.clone(), [seq]).sampled_token_ids[0] for _ in range(10)]
    assert first == again and len(set(first)) > 1


def test_unseeded_rows_differ_across_draws():
    logits = torch.zeros(1, 1000)
    sampler = Sampler(1000)
    draws = [sampler(logits.clone(), [make_seq()]).sampled_token_ids[0] for _ in range(10)]
    assert len(set(draws)) > 5
    batch = sampler(torch.zeros(10, 1000), [make_seq() for _ in range(10)]).sampled_token_ids
    assert len(set(batch)) > 5


def chi_square(counts, probs):
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distribution_unseeded(temperature):
    probs = np.array([0.2, 0.5, 0.3])
    num_draws = 20000
    logits = torch.tensor(np.log(probs), dtype=torch.float32).repeat(num_draws, 1)
    torch.manual_seed(0)
    sampled = Sampler(3)(logits, [make_seq(temperature=temperature)] * num_draws)
    counts = np.bincount(sampled.sampled_token_ids, minlength=3)
    expected = probs ** (1 / temperature)
    expected /= expected.sum()
    assert chi_square(counts, expected) < 13.8  # df = 2, p = 0.001


def test_distribution_seeded_stream():
    probs = [0.2, 0.5, 0.3]
    logits = torch.tensor(probs).log()[None, :]
    sampler, seq = Sampler(3), make_seq(seed=1234)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(logits.clone(), [seq]).sampled_token_ids[0]] += 1
    assert chi_square(counts, probs) < 13.8


# ---- logprobs -------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = random_logits(3, 50, seed=5)
    seqs = [make_seq(logprobs=3, temperature=0.9, seed=1, output=[4, 4], repetition_penalty=1.5),
            make_seq(temperature=0.0),
            make_seq(logprobs=0, temperature=0.0, presence_penalty=2.0, output=[7])]
    out = Sampler(50)(logits.clone(), seqs)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i, k in ((0, 3), (2, 0)):
        position = out.logprobs[i]
        token_ids = list(position)
        sampled = out.sampled_token_ids[i]
        assert token_ids[0] == sampled
        order = reference[i].argsort(descending=True).tolist()
        top = order[:k]
        assert set(token_ids) == {sampled, *top}
        for token_id, logprob in position.items():
            assert abs(logprob.logprob - reference[i, token_id].item()) < 1e-6
            assert logprob.rank == order.index(token_id) + 1
            assert logprob.decoded_token is None
    assert len(out.logprobs[2]) == 1


def test_logprobs_rank_of_a_low_sampled_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    seq = make_seq(temperature=0.0, logprobs=2, logit_bias={4: 10.0})
    out = Sampler(5)(logits.clone(), [seq])
    assert out.sampled_token_ids == [4]
    assert [(t, lp.rank) for t, lp in out.logprobs[0].items()] == [(4, 5), (0, 1), (1, 2)]


@pytest.mark.parametrize("chunk", [2, 256])
def test_prompt_logprobs(monkeypatch, chunk):
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGPROBS_CHUNK", chunk)
    logits = random_logits(5, 30, seed=9)
    next_ids = [3, 0, 29, 3, 11]
    result = compute_prompt_logprobs(logits, next_ids, k=2)
    reference = torch.log_softmax(logits, dim=-1)
    assert len(result) == 5
    for p, position in enumerate(result):
        order = reference[p].argsort(descending=True).tolist()
        assert list(position)[0] == next_ids[p]
        assert set(position) == {next_ids[p], *order[:2]}
        for token_id, logprob in position.items():
            assert math.isclose(logprob.logprob, reference[p, token_id].item(), abs_tol=1e-6)
            assert logprob.rank == order.index(token_id) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.0, top_k=20)], ids=str)
def test_a_seeded_row_is_drawn_by_inverse_cdf_at_its_generators_uniform(dtype, params):
    """One float64 uniform per row and step, from the row's own generator, at which the reference
    inverse-CDF draw of the tempered (and truncated) distribution gives the token; bf16 logits
    are drawn as they are."""
    seq = make_seq(seed=5, **params)
    generator = torch.Generator().manual_seed(seq.sample_seed)
    sampler = Sampler(1000)
    for step in range(20):
        logits = random_logits(1, 1000, seed=step).to(dtype)
        expected_logits = logits.float() / params["temperature"]
        apply_top_k_top_p(expected_logits, [seq])
        u = torch.rand(1, dtype=torch.float64, generator=generator)
        expected = reference.sample_rows(expected_logits, u)
        assert sampler(logits.clone(), [seq]).sampled_token_ids == expected.tolist()
