"""The real AsyncEngine with one injectable fault: once the file named by PAGEDSERVE_FAULT_FILE
exists, the engine's step raises a few steps later (the file is consumed), so its background loop
dies the way a device failure or a bug would kill it."""
from __future__ import annotations

import os

from replicas.async_engine import AsyncEngine
from replicas.config import EngineConfig

STEPS_BEFORE_FAULT = 3


class FaultyEngine(AsyncEngine):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        step = self.engine.step
        fault_file = os.environ.get("PAGEDSERVE_FAULT_FILE", "")
        fire_at: list[int] = []

        def faulty_step():
            if not fire_at and fault_file and os.path.exists(fault_file):
                os.remove(fault_file)
                fire_at.append(self.engine.num_steps + STEPS_BEFORE_FAULT)
            if fire_at and self.engine.num_steps >= fire_at[0]:
                raise RuntimeError("injected engine fault")
            return step()

        self.engine.step = faulty_step
