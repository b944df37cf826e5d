"""AsyncEngine: one background loop stepping an LLMEngine; each request an async stream.

engine.step() runs in a single worker thread (torch releases the GIL), so the event loop keeps
accepting and streaming while the model computes. Only the loop touches the engine's state:
new requests and aborts are queued and applied between steps.

`generate()` and `embed()` come from `EngineClient`, over `add_request(..., on_output)`: a
callback the loop calls with each output (and with the error if the request fails), for a caller
that batches many requests' outputs itself. In a serving replica the same loop usually runs in a
process of its own (`replicas/engine_core.py`), where it competes with no event loop for the GIL.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.engine_client import (MAX_CONSECUTIVE_STEP_FAILURES, EngineClient, EngineDeadError,
                                    OnOutput)
from replicas.errors import StepFailed
from replicas.outputs import RequestOutput
from replicas.request import PromptInput, Request
from replicas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine(EngineClient):
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name
        self.block_size = self.engine.block_size
        self.vocab_size = self.engine.runner.vocab_size
        self._receivers: dict[str, OnOutput] = {}
        self._pending: list[Request] = []
        self._aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._error: BaseException | None = None
        # Wall-clock time the engine last sampled a token (readiness: it really generates).
        self.last_generation_time: float | None = None

    # -- public -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None,
                    on_output: OnOutput, priority: int = 0) -> None:
        """Validate (ValueError here, for a bad request) and queue a request; the loop calls
        `on_output` with each of its outputs, or once with the error that ended it."""
        self._check_alive()
        if request_id in self._receivers:
            raise ValueError(f"request id {request_id!r} is already running")
        request = self.engine.make_request(request_id, prompt, params, priority=priority)
        self._receivers[request_id] = on_output
        self._pending.append(request)
        self._ensure_loop()
        self._wakeup.set()

    def abort_nowait(self, request_id: str) -> None:
        self._receivers.pop(request_id, None)
        self._aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats["num_waiting"] += len(self._pending)
        stats["healthy"] = self.is_healthy()
        stats["last_generation_time"] = self.last_generation_time
        return stats

    def is_healthy(self) -> bool:
        return self._error is None and (self._loop_task is None or not self._loop_task.done())

    async def check_health(self) -> None:
        self._check_alive()

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the loop -----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError(f"the engine loop has stopped: {self._error!r}")

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not self._pending and not self._aborts:
                        await self._wakeup.wait()
                    continue
                generated = self.engine.num_generation_tokens
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except StepFailed as exc:
                    failures += 1
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    self._fail(exc.request_ids, exc)
                    continue
                failures = 0
                if self.engine.num_generation_tokens > generated:
                    self.last_generation_time = time.time()
                self._deliver(outputs)
                for request_id, exc in self.engine.take_failures():
                    receiver = self._receivers.pop(request_id, None)
                    if receiver is not None:
                        receiver(exc)
                await asyncio.sleep(0)  # let streams and new requests in between steps
        except asyncio.CancelledError:
            self._error = EngineDeadError("the engine loop was shut down")
            self._fail_all(self._error)
            raise
        except BaseException as exc:  # a bug or a device failure: fail every stream loudly
            logger.exception("engine loop died")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine loop died: {exc!r}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        receivers = self._receivers
        for output in outputs:
            receiver = receivers.pop(output.request_id, None) if output.finished \
                else receivers.get(output.request_id)
            if receiver is not None:
                receiver(output)

    def _apply_pending(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            if self.engine.abort_request(request_id) is None:  # maybe not added yet
                self._pending = [r for r in self._pending if r.request_id != request_id]
        pending, self._pending = self._pending, []
        for request in pending:
            try:
                self.engine.add(request)
            except ValueError as exc:
                receiver = self._receivers.pop(request.request_id, None)
                if receiver is not None:
                    receiver(exc)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            receiver = self._receivers.pop(request_id, None)
            if receiver is not None:
                receiver(exc)

    def _fail_all(self, exc: BaseException) -> None:
        receivers, self._receivers = self._receivers, {}
        for receiver in receivers.values():
            receiver(exc)
