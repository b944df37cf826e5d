"""The simulator against the real thing: the same small shared-prefix workload through the real
2-replica Ray Serve app and through `bench.fleet` with 2 simulated replicas of the same KV size;
their prefix-cache hit rates must agree within 0.05.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from bench.fleet.cost_model import CostModel
from bench.fleet.fleet import Fleet, FleetSettings
from bench.fleet.replica import ReplicaSettings, Request
from bench.fleet.workloads import Workload, WorkloadSettings
from pagedserve.replicas.core.block_hash import block_hashes
from tests.serve.conftest import deploy
from tests.serve.test_routing import VOCAB, run

APP = "fleetcmp"
PREFIX = "/fleetcmp"
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 96  # per replica: less than the 8 system prompts' 8 x 12 blocks plus the turns
MAX_TOKENS = 4
SPACING_S = 0.5  # one request at a time, in both worlds


@pytest.fixture(scope="module")
def fleetcmp_app(cluster, tiny_model_dir):
    from ray import serve

    deploy(dict(model=tiny_model_dir, served_model_name="tiny", num_replicas=2, replica_num_cpus=0.5,
                max_model_len=512, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8,
                block_size=BLOCK_SIZE), APP, PREFIX)
    yield f"{cluster.base_url}{PREFIX}"
    serve.delete(APP)


def workload_prompts() -> list[list[int]]:
    rng = random.Random(5)
    systems = [[rng.choice(VOCAB) for _ in range(12 * BLOCK_SIZE)] for _ in range(8)]
    turns = [(s, [rng.choice(VOCAB) for _ in range(rng.randint(5, 40))])
             for s in range(8) for _ in range(5)]
    rng.shuffle(turns)
    return [systems[s] + turn for s, turn in turns]


class ListedWorkload(Workload):
    """Given prompts, one every SPACING_S seconds."""

    def __init__(self, prompts: list[list[int]]):
        super().__init__("nosharing", WorkloadSettings(rate=1 / SPACING_S, num_stages=1,
                                                       duration_s=SPACING_S * len(prompts) + 30),
                         seed=0)
        self.prompts = prompts

    def requests(self):
        for i, prompt in enumerate(self.prompts):
            hashes = block_hashes(prompt, BLOCK_SIZE)
            extra = (len(prompt) + MAX_TOKENS) // BLOCK_SIZE - len(hashes)
            yield Request(f"r{i}", i * SPACING_S, len(prompt), MAX_TOKENS,
                          hashes + self._hashes(extra))


def simulated_hit_rate(prompts: list[list[int]]) -> float:
    replica = ReplicaSettings(num_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
                              max_num_batched_tokens=2048)
    fleet = Fleet("pagedserve", ListedWorkload(prompts), CostModel(0.005, 5e-5, 1e-3),
                  FleetSettings(num_replicas=2, replica=replica), seed=0).run()
    o = fleet.outcome
    return sum(o.cached_tokens) / sum(o.prompt_tokens)


@pytest.mark.long
def test_two_simulated_replicas_hit_like_the_real_app(fleetcmp_app):
    prompts = workload_prompts()
    usages = asyncio.run(run(fleetcmp_app, prompts, concurrency=1, max_tokens=MAX_TOKENS,
                             spacing_s=SPACING_S))
    measured = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) / \
        sum(u["prompt_tokens"] for u in usages)
    simulated = simulated_hit_rate(prompts)
    assert abs(simulated - measured) <= 0.05, (simulated, measured)
