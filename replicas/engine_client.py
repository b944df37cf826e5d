"""EngineClient: what the replica shim and the readiness probe use of an engine, whichever process
its loop runs in (vLLM's name for the same seam).

A subclass queues requests with `add_request(..., on_output)` (the callback gets each output, or
once the error that ended the request) and stops them with `abort_nowait`; this base turns that
into `generate()` (an async iterator; a consumer that fell behind gets its pending deltas as one
output) and `embed()` (one prefill-only pooling request per input). `AsyncEngine` steps the
engine in a thread of this process; `EngineCoreClient` talks to it in a process of its own.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import numpy as np

from replicas.config import EngineConfig
from replicas.output_queue import OutputQueue
from replicas.outputs import RequestOutput
from replicas.pooling import pooling_params
from replicas.request import PromptInput
from replicas.sampling_params import ParamError, RequestOutputKind, SamplingParams

OnOutput = Callable[[RequestOutput | BaseException], None]
# A failed step fails only its own requests; this many failed steps in a row means the engine is
# broken (not one bad batch), and the loop stops so the replica reports unhealthy and is replaced.
MAX_CONSECUTIVE_STEP_FAILURES = 2


class EngineDeadError(RuntimeError):
    pass


class EngineClient:
    config: EngineConfig
    model_name: str

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None,
                    on_output: OnOutput, priority: int = 0) -> None:
        raise NotImplementedError

    def abort_nowait(self, request_id: str) -> None:
        """Stop a request between steps and free its blocks; its receiver hears nothing more."""
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("generate", "embed") if self.config.pooling else ("generate",)

    async def generate(self, prompt: PromptInput, params: SamplingParams | None, request_id: str,
                       priority: int = 0, **routing) -> AsyncIterator[RequestOutput]:
        """Stream outputs of the request's `output_kind`. Raises ValueError before the first
        output for a bad request; leaving the iteration early (or being cancelled) aborts the
        request and frees its blocks. `routing` goes to `add_request` (EngineCoreClient's
        `channel_id`)."""
        params = params or SamplingParams()
        queue = OutputQueue(aggregate=params.output_kind is RequestOutputKind.DELTA)
        self.add_request(request_id, prompt, params, queue.put, priority, **routing)
        try:
            async for output in queue:
                yield output
        finally:
            if not queue.finished:
                self.abort_nowait(request_id)

    async def embed(self, token_ids: list[list[int]]) -> np.ndarray:
        """One pooling request per input (prefill only: the scheduler batches them with every
        other request) -> float32 [len(token_ids), hidden]; ValueError for a bad input."""
        if self.config.pooling is None:
            raise ParamError("model", f"the model {self.model_name} does not serve embeddings (the "
                             "engine setting pooling makes a decoder embed too)")
        params = pooling_params(self.config.pooling)
        loop = asyncio.get_running_loop()
        request_ids = [f"embed-{uuid.uuid4().hex}-{i}" for i in range(len(token_ids))]
        futures = [loop.create_future() for _ in token_ids]

        def receiver(future: asyncio.Future) -> OnOutput:
            def on_output(item: RequestOutput | BaseException) -> None:
                if future.done():
                    return
                if isinstance(item, BaseException):
                    future.set_exception(item)
                elif item.finished and item.embedding is None:
                    future.set_exception(EngineDeadError("the embedding request was aborted"))
                elif item.finished:
                    future.set_result(item.embedding)
            return on_output

        try:
            for request_id, ids, future in zip(request_ids, token_ids, futures):
                self.add_request(request_id, {"prompt_token_ids": ids}, params, receiver(future))
            rows = await asyncio.gather(*futures)
        finally:
            for request_id, future in zip(request_ids, futures):
                if not future.done():  # cancelled, or a sibling failed: free its blocks
                    future.cancel()
                    self.abort_nowait(request_id)
        return np.asarray(rows, dtype=np.float32).reshape(len(token_ids), -1)
