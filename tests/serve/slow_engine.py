"""The real AsyncEngine, each step made STEP_DELAY_S longer: long generations on a tiny model,
so that a test can act (kill a replica) while streams are in flight. SlowCoreEngine is the same
in an engine core process (tests/serve/slow_core.py)."""
from __future__ import annotations

import time

from replicas.async_engine import AsyncEngine
from replicas.config import EngineConfig
from replicas.engine_core_client import EngineCoreClient

STEP_DELAY_S = 0.005
STEP_DELAY_ENV = "PAGEDSERVE_TEST_STEP_DELAY_S"  # a slow core's delay (tests/serve/slow_core.py)


class SlowEngine(AsyncEngine):
    step_delay_s = STEP_DELAY_S

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        step = self.engine.step

        def slow_step():
            time.sleep(self.step_delay_s)  # in the engine's step thread, like a slow forward
            return step()

        self.engine.step = slow_step


class VerySlowEngine(SlowEngine):
    """100 ms a step: 240 tokens take about 24 s, longer than Ray Serve's default drain (20 s)."""

    step_delay_s = 0.1


class SlowCoreEngine(EngineCoreClient):
    core_module = "tests.serve.slow_core"


class VerySlowCoreEngine(SlowCoreEngine):
    """VerySlowEngine's steps in an engine core process: ingresses send it requests on its
    channel."""

    def __init__(self, config: EngineConfig):
        import os
        os.environ[STEP_DELAY_ENV] = str(VerySlowEngine.step_delay_s)  # the core inherits it
        super().__init__(config)
