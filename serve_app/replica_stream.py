"""One engine replica's delta stream as seen by the ingress, and the merge of several."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from replicas.deployment import EngineReplicaDead, GenerateDelta
from serve_app import errors
from serve_app.errors import OpenAIError

logger = logging.getLogger(__name__)

_END = object()


class ReplicaStream:
    """One streaming replica call: `prime()` sends it and waits for the first delta, so errors
    (a full queue, a bad request) surface before a response starts; iteration maps replica errors
    with `map_error`."""

    def __init__(self, send: Callable[[], Any], map_error: Callable[[BaseException], BaseException]):
        self.send = send  # returns a DeploymentResponseGenerator
        self.generator = None
        self.map_error = map_error
        self.first: GenerateDelta | None = None
        self.first_delta_time: float | None = None
        self.finished = False

    async def prime(self) -> None:
        try:
            self.generator = self.send()
            self.first = await self.generator.__anext__()
        except StopAsyncIteration:
            self.finished = True
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                self.cancel()
            self.finished = True  # a failed call holds nothing to cancel
            raise self.map_error(exc) from None
        self.first_delta_time = time.monotonic()

    def cancel(self) -> None:
        """Abort the replica call. Never blocks the event loop: cancelling a call that has not
        reached a replica yet waits for its assignment, so that happens in a thread."""
        if self.finished or self.generator is None:
            return
        self.finished = True
        if self.first_delta_time is not None:
            _cancel_quietly(self.generator)
        else:
            asyncio.get_running_loop().run_in_executor(None, _cancel_quietly, self.generator)

    async def __aiter__(self) -> AsyncIterator[GenerateDelta]:
        if self.first is not None:
            first, self.first = self.first, None
            yield first
            if first.finished:
                self.finished = True
                return
        while not self.finished:
            try:
                delta = await self.generator.__anext__()
            except StopAsyncIteration:
                self.finished = True
                return
            except BaseException as exc:
                raise self.map_error(exc) from None
            self.finished = delta.finished
            yield delta


def map_replica_error(exc: BaseException, retry_after_s: int,
                      mark_dead: Callable[[str], None]) -> BaseException:
    """An exception from a replica call, as the OpenAIError a client should see."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, (OpenAIError, asyncio.CancelledError)):
        return exc
    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    if isinstance(cause, BackPressureError):
        return errors.overloaded(retry_after_s)
    if isinstance(cause, EngineReplicaDead):
        mark_dead(cause.replica_id)
        return errors.unavailable(f"the engine failed: {cause}", retry_after_s)
    if isinstance(cause, (RayActorError, DeploymentUnavailableError)):
        return errors.unavailable("no engine replica is available", retry_after_s)
    if isinstance(cause, ValueError):  # the engine rejected the request
        return errors.bad_request(str(cause))
    logger.error("unexpected error from an engine replica: %r", exc)
    return errors.internal_error(cause)


def as_own_call(send: Callable[[], Any], index: int) -> Callable[[], Any]:
    """send, made under a request id of its own: for one HTTP request that fans out to several
    replica calls (a prompt list). Ray Serve 2.60's router indexes pending calls by the request's
    internal id and skips an id it already holds, so a second concurrent call under the same id
    could wait for a replica forever. Our own cancel paths (ReplicaStream.cancel) still cover a
    client disconnect, which Ray would otherwise propagate by that id."""
    def call():
        import dataclasses

        from ray.serve import context
        parent = context._get_serve_request_context()
        context._serve_request_context.set(dataclasses.replace(
            parent, _internal_request_id=f"{parent._internal_request_id or 'call'}-{index}"))
        return send()  # in prime()'s own task, so the new id stays with this call
    return call


def _cancel_quietly(generator) -> None:
    try:
        generator.cancel()
    except Exception:  # noqa: BLE001 - it failed or finished already: nothing left to cancel
        pass


async def merge_streams(streams: list[ReplicaStream]) -> AsyncIterator[tuple[int, GenerateDelta]]:
    """(stream index, delta) as they arrive. One stream is iterated directly (the common case)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: ReplicaStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
            queue.put_nowait((i, _END))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
