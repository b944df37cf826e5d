"""The real LLMEngine with injectable faults (an engine core runs it as
`engine_class="tests.serve.faulty_engine:FaultyEngine"`). Once the file named by PAGEDSERVE_FAULT_FILE
exists, it is consumed and, a few steps later, its contents choose the fault:

- "die" (or empty): every forward pass from then on raises, as a broken device would: the first
  failed step fails its requests, the second in a row stops the engine core's loop.
- "once": one forward pass raises, as a bad batch would: its requests fail, the rest go on.
- "stall": the forward pass hangs, as a wedged device would: the engine has work and makes no steps.
"""
from __future__ import annotations

import os
import threading

from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.engine.core import PROBE_ID_PREFIX
from pagedserve.replicas.engine.llm_engine import LLMEngine

STEPS_BEFORE_FAULT = 8
STALL_S = 600.0


class FaultyEngine(LLMEngine):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        runner = self.runner
        execute = runner.execute
        fault_file = os.environ.get("PAGEDSERVE_FAULT_FILE", "")
        armed: dict = {}  # "steps": requests' steps left before the fault fires, "mode": which
        never = threading.Event()

        def faulty_execute(scheduler_output):
            if not armed and fault_file and os.path.exists(fault_file):
                with open(fault_file) as f:
                    mode = f.read().strip() or "die"
                os.remove(fault_file)
                armed.update(steps=STEPS_BEFORE_FAULT, mode=mode)
            # Only steps that run a request count: an idle core's readiness probes step too, and
            # must not spend the steps before the fault while the test's request is on its way.
            if armed and not _probes_only(scheduler_output):
                armed["steps"] -= 1
            if armed and armed["steps"] < 0:
                if armed["mode"] == "stall":
                    never.wait(STALL_S)
                elif armed["mode"] == "once":
                    armed.clear()
                    raise RuntimeError("injected step fault")
                else:
                    raise RuntimeError("injected engine fault")
            return execute(scheduler_output)

        runner.execute = faulty_execute


def _probes_only(scheduler_output) -> bool:
    return all(item.seq.request_id.startswith(PROBE_ID_PREFIX) for item in scheduler_output.scheduled)
