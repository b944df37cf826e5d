"""The peers benchmark's token agreement: what it counts as identical, and the matching prefix."""
from __future__ import annotations

import argparse

from bench.peers.offline import agreement_table


def test_agreement_counts_identical_requests_and_matching_prefixes():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    table = agreement_table(argparse.Namespace(dtype="bfloat16"),
                            {"pagedserve": ours, "vllm-bf16": theirs, "vllm": theirs})
    # "vllm" ran at args.dtype too: every pair compares, each request's prefix up to its first difference.
    assert set(table) == {"pagedserve vs vllm", "pagedserve vs vllm-bf16", "vllm vs vllm-bf16"}
    row = table["pagedserve vs vllm-bf16"]
    assert (row["identical_requests"], row["requests"]) == (1, 3)
    assert abs(row["mean_matching_prefix"] - (1 + 0.5 + 0) / 3) < 1e-12
    assert table["vllm vs vllm-bf16"]["identical_requests"] == 3


def test_transformers_is_the_yardstick_of_two_independent_implementations():
    table = agreement_table(argparse.Namespace(dtype="bfloat16"),
                            {"pagedserve": [[1, 2]], "transformers": [[1, 3]], "vllm-bf16": [[1, 2]]})
    assert table["pagedserve vs vllm-bf16"]["identical_requests"] == 1
    assert table["transformers vs vllm-bf16"]["identical_requests"] == 0
    assert table["pagedserve vs transformers"]["mean_matching_prefix"] == 0.5


def test_agreement_skips_peers_of_another_dtype():
    table = agreement_table(argparse.Namespace(dtype="float32"),
                            {"pagedserve": [[1]], "vllm-bf16": [[1]]})
    assert table == {}
