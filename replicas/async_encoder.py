"""AsyncEncoderEngine: an EncoderEngine behind a small batcher, for an encoder-model replica.

Concurrent `embed()` calls are gathered into shared forward passes: the loop waits up to
`BATCH_WAIT_S` for more sequences while a batch is not full, then packs whatever has arrived (in
arrival order, up to the engine's token and sequence budget) into one pass, run in a worker thread
so the event loop keeps accepting requests meanwhile. A request larger than one batch spans
several passes and completes when its last row has been embedded.

It offers the surface `EngineReplica` uses of an `AsyncEngine` (tokenizer, stats, health); it does
not generate: `generate`/`add_request` raise a ParamError saying so.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from replicas.async_engine import EngineDeadError
from replicas.config import EngineConfig
from replicas.embedding_model import resolve_model_name
from replicas.encoder_engine import EncoderEngine
from replicas.sampling_params import ParamError

logger = logging.getLogger(__name__)

# How long a batch that is not full waits for more sequences: small next to a forward pass of a
# few texts (~5 ms on one core), so a lone request barely waits and concurrent ones share a pass.
BATCH_WAIT_S = 0.002


@dataclass(eq=False, slots=True)
class _Pending:
    token_ids: list[list[int]]
    out: np.ndarray
    future: asyncio.Future
    next_row: int = 0  # rows before this one are in a batch already
    num_done: int = 0


class AsyncEncoderEngine:
    tasks = EncoderEngine.tasks

    def __init__(self, config: EngineConfig, engine: EncoderEngine | None = None):
        self.engine = engine or EncoderEngine(config, resolve_model_name(config.model))
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name
        self.block_size = self.engine.block_size
        self.hidden_size = self.engine.model.hidden_size
        self._queue: deque[_Pending] = deque()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder-step")
        self._error: BaseException | None = None
        self._num_running = 0
        self._in_flight: list[_Pending] = []
        # Wall-clock time a batch was last embedded (readiness: it really computes).
        self.last_generation_time: float | None = None

    # -- public -------------------------------------------------------------------------------
    async def embed(self, token_ids: list[list[int]]) -> np.ndarray:
        """Token-id lists -> float32 [len(token_ids), hidden]; a ParamError for a bad input."""
        self._check_alive()
        for ids in token_ids:
            self.engine.check(ids)
        pending = _Pending(token_ids, np.empty((len(token_ids), self.hidden_size), np.float32),
                           asyncio.get_running_loop().create_future())
        if not token_ids:
            return pending.out
        self._queue.append(pending)
        self._ensure_loop()
        self._wakeup.set()
        try:
            return await pending.future
        finally:
            if not pending.future.done():  # cancelled: rows not yet batched are skipped
                pending.future.cancel()

    def add_request(self, request_id, prompt, params, on_output) -> None:
        raise ParamError("model", f"the model {self.model_name} does not generate text: it is an "
                         "embedding model (use /v1/embeddings)")

    async def generate(self, prompt, params, request_id):
        self.add_request(request_id, prompt, params, None)
        yield  # pragma: no cover - never reached

    def abort_nowait(self, request_id: str) -> None:
        pass

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats["num_waiting"] = sum(len(p.token_ids) - p.next_row for p in self._queue)
        stats["num_running"] = self._num_running
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
            raise EngineDeadError(f"the encoder loop has stopped: {self._error!r}")

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._drop_cancelled()
                if not self._queue:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                if not self._batch_is_full():
                    await asyncio.sleep(BATCH_WAIT_S)
                    self._drop_cancelled()
                batch = self._take_batch()
                if not batch:
                    continue
                token_ids = [ids for pending, start, end in batch
                             for ids in pending.token_ids[start:end]]
                self._num_running = len(token_ids)
                self._in_flight = [pending for pending, _, _ in batch]
                try:
                    rows = await loop.run_in_executor(self._executor, self.engine.embed_batch,
                                                      token_ids)
                finally:
                    self._num_running = 0
                self.last_generation_time = time.time()
                self._deliver(batch, rows)
                self._in_flight = []
        except asyncio.CancelledError:
            self._error = EngineDeadError("the encoder loop was shut down")
            self._fail_all(self._error)
            raise
        except BaseException as exc:  # a bug or a device failure: fail every request loudly
            logger.exception("encoder loop died")
            self._error = exc
            self._fail_all(EngineDeadError(f"the encoder loop died: {exc!r}"))

    def _drop_cancelled(self) -> None:
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()
        if any(p.future.done() for p in self._queue):
            self._queue = deque(p for p in self._queue if not p.future.done())

    def _batch_is_full(self) -> bool:
        num_seqs = num_tokens = 0
        for pending in self._queue:
            for ids in pending.token_ids[pending.next_row:]:
                num_seqs += 1
                num_tokens += len(ids)
                if num_seqs >= self.engine.max_num_seqs \
                        or num_tokens >= self.engine.max_num_batched_tokens:
                    return True
        return False

    def _take_batch(self) -> list[tuple[_Pending, int, int]]:
        """(request, first row, end row) slices, in arrival order, that fit one pass."""
        batch, num_seqs, num_tokens = [], 0, 0
        max_seqs, max_tokens = self.engine.max_num_seqs, self.engine.max_num_batched_tokens
        while self._queue:
            pending = self._queue[0]
            start = end = pending.next_row
            while end < len(pending.token_ids) and num_seqs < max_seqs:
                size = len(pending.token_ids[end])
                if num_seqs and num_tokens + size > max_tokens:
                    break
                num_seqs, num_tokens, end = num_seqs + 1, num_tokens + size, end + 1
            if end > start:
                batch.append((pending, start, end))
                pending.next_row = end
            if end < len(pending.token_ids):
                break  # the batch is full
            self._queue.popleft()
        return batch

    def _deliver(self, batch: list[tuple[_Pending, int, int]], rows: np.ndarray) -> None:
        offset = 0
        for pending, start, end in batch:
            pending.out[start:end] = rows[offset:offset + end - start]
            offset += end - start
            pending.num_done += end - start
            if pending.num_done == len(pending.token_ids) and not pending.future.done():
                pending.future.set_result(pending.out)

    def _fail_all(self, exc: BaseException) -> None:
        queue, self._queue = [*self._in_flight, *self._queue], deque()
        self._in_flight = []
        for pending in queue:
            if not pending.future.done():
                pending.future.set_exception(exc)
