"""The readiness probe proves what the engine serves: a generation, or for an embedding-only
engine an embedding."""
from __future__ import annotations

import asyncio

from replicas.readiness_probe import ReadinessProbe


class _EmbeddingOnly:
    tasks = ("embed",)
    tokenizer = None
    last_generation_time = None

    def __init__(self):
        self.embedded = []

    def stats(self):
        return {"num_waiting": 0, "num_running": 0}

    async def generate(self, *args):  # an encoder refuses to generate
        raise ValueError("does not generate")
        yield

    async def embed(self, token_ids):
        self.embedded.append(token_ids)
        self.last_generation_time = 1.0


def test_an_embedding_only_engine_is_probed_with_an_embedding():
    engine = _EmbeddingOnly()
    probe = ReadinessProbe(engine, interval_s=10, clock=lambda: 100.0)
    assert probe.due()
    asyncio.run(probe.probe_once())
    assert engine.embedded == [[[0]]] and engine.last_generation_time == 1.0
