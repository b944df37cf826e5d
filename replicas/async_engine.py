"""AsyncEngine: one background loop stepping an LLMEngine; each request an async stream.

engine.step() runs in a single worker thread (torch releases the GIL), so the event loop keeps
accepting and streaming while the model computes. Only the loop touches the engine's state:
new requests and aborts are queued and applied between steps.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from replicas.config import EngineConfig
from replicas.engine import LLMEngine, PromptInput
from replicas.outputs import RequestOutput
from replicas.request import Request
from replicas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name
        self.block_size = self.engine.block_size
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending: list[Request] = []
        self._aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._error: BaseException | None = None

    # -- public -------------------------------------------------------------------------------
    async def generate(self, prompt: PromptInput, params: SamplingParams | None, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs. Raises ValueError before the first output for a bad request;
        leaving the iteration early (or being cancelled) aborts the request and frees its blocks."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        request = self.engine.make_request(request_id, prompt, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._pending.append(request)
        self._ensure_loop()
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                while not stream.empty():  # outputs are cumulative: the newest supersedes the rest
                    item = stream.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._aborts.append(request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats["num_waiting"] += len(self._pending)
        stats["healthy"] = self.is_healthy()
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
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not self._pending and not self._aborts:
                        await self._wakeup.wait()
                    continue
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put_nowait(output)
                await asyncio.sleep(0)  # let streams and new requests in between steps
        except asyncio.CancelledError:
            self._error = EngineDeadError("the engine loop was shut down")
            self._fail_all(self._error)
            raise
        except BaseException as exc:  # a bug or a device failure: fail every stream loudly
            logger.exception("engine loop died")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine loop died: {exc!r}"))

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
                stream = self._streams.get(request.request_id)
                if stream is not None:
                    stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)
