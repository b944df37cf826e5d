"""The peers benchmark's token agreement: what it counts as identical, and the matching prefix."""
from __future__ import annotations

import argparse

from bench.peers.offline import agreement_table


def test_agreement_counts_identical_requests_and_matching_prefixes():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    table = agreement_table(argparse.Namespace(dtype="bfloat16"),
                            {"pagedserve": ours, "vllm-bf16": theirs, "vllm": theirs})
    # "vllm" ran at args.dtype too; both compare, each request's prefix up to its first difference.
    assert set(table) == {"vllm", "vllm-bf16"}
    row = table["vllm-bf16"]
    assert (row["identical_requests"], row["requests"]) == (1, 3)
    assert abs(row["mean_matching_prefix"] - (1 + 0.5 + 0) / 3) < 1e-12


def test_agreement_skips_peers_of_another_dtype():
    table = agreement_table(argparse.Namespace(dtype="float32"),
                            {"pagedserve": [[1]], "vllm-bf16": [[1]]})
    assert table == {}
