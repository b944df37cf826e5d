"""Prefix-affinity routing on real Ray Serve: 2 engine replicas of the tiny model, HTTP in front.

Prompts are token ids (`/v1/completions` takes them as is), so the test knows every block hash.
"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from bench.routing import ideal_cached_tokens
from pagedserve.replicas.core.block_hash import block_hashes
from tests.serve.conftest import core_digests, deploy

APP = "routing"
PREFIX = "/routing"
BLOCK_SIZE = 16
VOCAB = range(10, 300)  # plain tokens of the tiny tokenizer (the specials sit below 3)
ROUTER_KWARGS = {"load_override_threshold": 3, "cold_home_max_excess_load": 2}


@pytest.fixture(scope="module")
def routing_app(cluster, tiny_model_dir):
    from ray import serve

    deploy(dict(model=tiny_model_dir, served_model_name="tiny", num_replicas=2, replica_num_cpus=0.5,
                max_model_len=512, num_kv_blocks=256, max_num_seqs=16, block_size=BLOCK_SIZE,
                request_router_kwargs=ROUTER_KWARGS), APP, PREFIX)
    yield f"{cluster.base_url}{PREFIX}"
    serve.delete(APP)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


async def complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int = 4) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


async def run(base_url: str, prompts: list[list[int]], concurrency: int, max_tokens: int = 4,
              spacing_s: float = 0.01) -> list[dict]:
    """Send prompts in order, at most `concurrency` in flight; returns each one's usage."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def one(prompt):
            async with gate:
                return await complete(client, prompt, max_tokens)

        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            await asyncio.sleep(spacing_s)  # keep arrival order = list order
        return await asyncio.gather(*tasks)


def digests() -> dict[str, set[int]]:
    """Each replica's cached block hashes, from its core's digest."""
    found = core_digests(APP)
    assert len(found) == 2, found
    return {replica: set(digest["kv_events"]["snapshot"]["block_hashes"])
            for replica, digest in found.items()}


def holders(prefix: list[int]) -> list[str]:
    first = block_hashes(prefix, BLOCK_SIZE)[0]
    return [replica for replica, hashes in digests().items() if first in hashes]


def test_shared_prefixes_land_on_one_replica_each_near_the_ideal_hit_rate(routing_app):
    rng = random.Random(1)
    systems = [tokens(rng, 8 * BLOCK_SIZE) for _ in range(4)]  # 4 "system prompts" of 8 blocks
    turns = [(s, tokens(rng, rng.randint(5, 20))) for s in range(4) for _ in range(6)]
    rng.shuffle(turns)  # interleaved
    prompts = [systems[s] + turn for s, turn in turns]
    usages = asyncio.run(run(routing_app, prompts, concurrency=2))

    ideal = sum(ideal_cached_tokens(prompts, BLOCK_SIZE)) / sum(len(p) for p in prompts)
    measured = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) / \
        sum(u["prompt_tokens"] for u in usages)
    assert measured >= 0.9 * ideal, (measured, ideal)
    for system in systems:
        assert len(holders(system)) == 1, "a shared prefix sprayed over replicas"


def test_a_burst_of_one_cold_prefix_converges(routing_app):
    rng = random.Random(2)
    system = tokens(rng, 6 * BLOCK_SIZE)
    prompts = [system + tokens(rng, 8) for _ in range(3)]  # concurrent, before any digest
    usages = asyncio.run(run(routing_app, prompts, concurrency=3, spacing_s=0))
    assert len(holders(system)) == 1
    # the first prefills the prefix, the others find it (in the same engine step, even)
    assert sum(u["prompt_tokens_details"]["cached_tokens"] >= 6 * BLOCK_SIZE for u in usages) == 2


def test_a_hot_prefix_spills_to_the_other_replica_when_its_queue_grows(routing_app):
    rng = random.Random(3)
    system = tokens(rng, 8 * BLOCK_SIZE)
    prompts = [system + tokens(rng, 8) for _ in range(12)]
    usages = asyncio.run(run(routing_app, prompts, concurrency=12, max_tokens=64, spacing_s=0))
    assert len(holders(system)) == 2, "the hot prefix never left its replica"
    # it spilled once, not per request: most requests still hit the cache
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] >= 8 * BLOCK_SIZE for u in usages)
    assert hits >= 8, hits
