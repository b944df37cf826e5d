"""bench.fleet.cost_model: the step-time formula, the least-squares fit, the JSON round trip."""
import random

import pytest

from bench.fleet.cost_model import GPU_PROFILES, CostModel, fit, load


def test_step_time_is_overhead_plus_prefill_tokens_plus_decode_seqs():
    m = CostModel(0.01, 1e-4, 2e-3)
    assert m.step_time(0, 0) == pytest.approx(0.01)
    assert m.step_time(100, 5) == pytest.approx(0.01 + 100 * 1e-4 + 5 * 2e-3)


def test_fit_recovers_the_coefficients_of_synthetic_steps():
    truth = CostModel(0.004, 3e-5, 2.5e-4)
    samples = [(p, d, truth.step_time(p, d)) for p in (0, 64, 512, 2048) for d in (0, 1, 8, 32)]
    fitted = fit(samples)
    assert fitted.step_overhead_s == pytest.approx(truth.step_overhead_s, rel=1e-9)
    assert fitted.prefill_token_s == pytest.approx(truth.prefill_token_s, rel=1e-9)
    assert fitted.decode_seq_s == pytest.approx(truth.decode_seq_s, rel=1e-9)


def test_fit_is_close_under_noise_and_never_negative():
    rng = random.Random(0)
    truth = CostModel(0.004, 3e-5, 2.5e-4)
    samples = [(p, d, truth.step_time(p, d) * rng.uniform(0.95, 1.05))
               for p in range(0, 4096, 256) for d in range(0, 64, 8)]
    fitted = fit(samples)
    assert fitted.prefill_token_s == pytest.approx(truth.prefill_token_s, rel=0.1)
    assert fitted.decode_seq_s == pytest.approx(truth.decode_seq_s, rel=0.1)
    # a decode cost that the data says is nil (noise makes it negative) is clamped at 0
    flat = fit([(p, d, 0.01 + p * 1e-5 - d * 1e-9) for p in (0, 10, 20) for d in (0, 1, 2)])
    assert flat.decode_seq_s == 0.0


def test_fit_refuses_samples_that_do_not_vary_both_counts():
    with pytest.raises(ValueError):
        fit([(10, 0, 0.1), (20, 0, 0.2), (30, 0, 0.3)])
    with pytest.raises(ValueError):
        fit([(10, 1, 0.1)])


def test_json_round_trip_and_profiles(tmp_path):
    path = tmp_path / "cpu.json"
    CostModel(0.002, 1e-4, 3e-4, "cpu").to_json(path, samples=3)
    assert load(str(path)) == CostModel(0.002, 1e-4, 3e-4, "cpu")
    h100, h200 = load("h100"), load("h200")
    assert h200.step_overhead_s < h100.step_overhead_s  # more bandwidth, same FLOP/s
    assert h200.prefill_token_s == h100.prefill_token_s
    assert all(v > 0 for m in GPU_PROFILES.values()
               for v in (m.step_overhead_s, m.prefill_token_s, m.decode_seq_s))
