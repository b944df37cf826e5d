"""The real LLMEngine, each step made `step_delay_s` longer: long generations on a tiny model, so
that a test can act (kill a replica, stop it) while streams are in flight. An engine core runs it
as `engine_class="tests.serve.slow_engine:SlowEngine"`."""
from __future__ import annotations

import time

from pagedserve.replicas.engine.llm_engine import LLMEngine

STEP_DELAY_S = 0.005


class SlowEngine(LLMEngine):
    step_delay_s = STEP_DELAY_S

    def step(self):
        time.sleep(self.step_delay_s)  # like a slow forward
        return super().step()


class VerySlowEngine(SlowEngine):
    """100 ms a step: 240 tokens take about 24 s, longer than Ray Serve's default drain (20 s)."""

    step_delay_s = 0.1
