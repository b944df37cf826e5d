"""bench.serving's model FLOP/s and MFU of a load-generator result."""
from __future__ import annotations

import pytest

from bench.peers.offline import model_flops
from bench.serving import FlopBasis, summarize

CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000}


def raw_result(input_lens, output_lens, duration=2.0) -> dict:
    return {"completed": sum(1 for o in output_lens if o), "failed": sum(1 for o in output_lens if not o),
            "request_throughput": 1.0, "output_throughput": 10.0, "duration": duration,
            "num_prompts": len(input_lens), "total_input_tokens": sum(input_lens),
            "total_output_tokens": sum(output_lens), "input_lens": input_lens, "output_lens": output_lens}


def test_mfu_counts_the_completed_requests_lengths_over_the_run():
    raw = raw_result([10, 20, 30], [5, 7, 0])  # the third failed: it generated nothing
    r = summarize(raw, FlopBasis(CONFIG, peak_gflops_per_s=4.0))
    expected = model_flops(CONFIG, [([0] * 10, 5), ([0] * 20, 7)]) / 2.0 / 1e9
    assert r["model_gflops_per_s"] == pytest.approx(expected)
    assert r["mfu"] == pytest.approx(expected / 4.0)
    assert "input_lens" not in r and r["total_input_tokens"] == 60


def test_no_mfu_without_a_basis_or_lengths():
    assert "mfu" not in summarize(raw_result([10], [5]))
    raw = raw_result([10], [5])
    del raw["input_lens"], raw["output_lens"]
    assert "mfu" not in summarize(raw, FlopBasis(CONFIG, 4.0))
