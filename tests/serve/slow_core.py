"""An engine core (replicas/engine_core.py) whose every step is made STEP_DELAY_S longer: long
generations on a tiny model in a core process, so a test can act while streams are in flight.

    python -m tests.serve.slow_core FD
"""
from __future__ import annotations

import os
import sys
import time

from replicas import engine
from replicas.engine_core import main
from tests.serve.slow_engine import STEP_DELAY_ENV, STEP_DELAY_S

if __name__ == "__main__":
    step = engine.LLMEngine.step

    delay_s = float(os.environ.get(STEP_DELAY_ENV, STEP_DELAY_S))

    def slow_step(self):
        time.sleep(delay_s)  # like a slow forward
        return step(self)

    engine.LLMEngine.step = slow_step
    sys.exit(main(int(sys.argv[1])))
