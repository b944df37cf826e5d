"""A replica proves it can generate: when its engine has sampled nothing for a while, it runs a
real one-token generation through the same engine, so "ready" means a token came out recently
rather than "the process is up". Busy engines need no probe: their own tokens are the proof.

Probes go through the scheduler and KV cache like any request (a one-token prompt, one output
token) and count in the engine's token counters.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from replicas.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PROBE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)


class ReadinessProbe:
    """`await probe.run()` until cancelled; `engine` is an AsyncEngine (or alike: `generate`,
    `stats`, `last_generation_time`, `tokenizer`)."""

    def __init__(self, engine, interval_s: float, *, clock=time.time):
        self.engine = engine
        self.interval_s = interval_s
        self.clock = clock
        self._ids = itertools.count()
        tokenizer = getattr(engine, "tokenizer", None)
        token = getattr(tokenizer, "bos_token_id", None)
        self.prompt = [token if token is not None else 0]

    def due(self) -> bool:
        stats = self.engine.stats()
        if stats.get("num_waiting", 0) or stats.get("num_running", 0):
            return False  # busy: its own tokens will prove it, or the stall check will fail it
        last = getattr(self.engine, "last_generation_time", None)
        return last is None or self.clock() - last >= self.interval_s

    async def probe_once(self) -> None:
        """A one-token generation, or for an embedding-only engine a one-token embedding."""
        request_id = f"readiness-probe-{next(self._ids)}"
        try:
            if "generate" in getattr(self.engine, "tasks", ("generate",)):
                async for _ in self.engine.generate(self.prompt, PROBE_PARAMS, request_id):
                    pass
            else:
                await self.engine.embed([self.prompt])
        except Exception as exc:  # noqa: BLE001 - a failed probe is what readiness reports
            logger.warning("readiness probe failed: %r", exc)

    async def run(self) -> None:
        while True:
            if self.due():
                await self.probe_once()
            await asyncio.sleep(min(1.0, self.interval_s / 4))
