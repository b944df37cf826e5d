"""Engine replicas' outputs as the ingress receives them: each request's stream, the output
channels shared by many requests, and the merge of several streams."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from replicas import core_wire, cpu_binding
from replicas.deployment import ChannelRequest, EngineReplicaDead, GenerateRequest, ReplicaHello
from replicas.errors import StepFailed
from replicas.output_channel import ChannelClosed
from replicas.output_queue import OutputQueue
from replicas.outputs import RequestOutput
from serve_app import errors
from serve_app.core_dispatch import CoreDispatch, CoreLink, Dispatched
from serve_app.errors import OpenAIError
from serve_app.routing import replica_events
from serve_app.stream_pacer import StreamPacer
from serve_app.stream_text import StreamText

logger = logging.getLogger(__name__)

_END = object()
CHANNEL_OPEN_TIMEOUT_S = 10.0
CHANNEL_RETRY_S = 5.0  # after a channel failed to open or broke, before trying that replica again
CORE_READ_SIZE = 1 << 20


class OutputChannels:
    """This ingress replica's output channels (`replicas/output_channel.py`), one per engine
    replica it has met, and the queue of every request it is waiting on.

    A request names the channel (`channel_id`); a replica where it is open sends the request's
    outputs there, in batches shared with every other request of this ingress, and a replica
    where it is not yet open streams them on the request's own call, first naming itself
    (`ReplicaHello`), so that the channel is opened for the requests after it.
    """

    def __init__(self, open_call: Callable[[ChannelRequest], Any] | None, retry_after_s: int = 1,
                 deployment: str = "EngineReplica"):
        self.open_call = open_call  # None: channels off (a request router that cannot pin them)
        self.channel_id = uuid.uuid4().hex if open_call is not None else None
        self._queues: dict[str, OutputQueue] = {}
        self._tasks: dict[str, asyncio.Task] = {}  # engine replica id -> its channel's pump
        self.links: dict[str, CoreLink] = {}  # engine replica id -> its open core channel
        self.dispatch = CoreDispatch(self.links, deployment, open_call is not None)
        self._retry_at: dict[str, float] = {}
        self._calls: dict[str, str] = {}  # Ray Serve's internal id of a call -> our request id
        self._call_of: dict[str, str] = {}  # and back: the id its router knows the request by
        self.retry_after_s = retry_after_s
        self._carries_core = False  # a channel straight to an engine core was opened
        replica_events.on_replica_lost(self._replica_lost)

    def follow_engine_cpus(self) -> None:
        """Once this ingress carries a core's tokens, keep off the CPUs of the cores that came
        (or back on those of the cores that went) since: a scale change moves no channel."""
        if self._carries_core:
            cpu_binding.keep_off_engine_cpus()

    def register(self, request_id: str) -> OutputQueue:
        self._queues[request_id] = queue = OutputQueue()
        return queue

    def unregister(self, request_id: str, call_id: str | None = None) -> None:
        self._queues.pop(request_id, None)
        self._call_of.pop(request_id, None)
        if call_id is not None:
            self._calls.pop(call_id, None)
            # Ray Serve does not report the end of every call to the router (a call cancelled
            # early may never be), so the router's record of it ends here too.
            replica_events.completed(call_id)

    def track(self, call_id: str | None, request_id: str) -> None:
        """The call carrying request_id: failed here if the router sees its replica die."""
        if call_id:
            self._calls[call_id] = request_id
            self._call_of[request_id] = call_id

    def _replica_lost(self, replica_id: str, call_ids: set[str]) -> None:
        for call_id in call_ids:
            request_id = self._calls.pop(call_id, "")
            self._call_of.pop(request_id, None)
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put(errors.unavailable("the engine replica serving this request died",
                                             self.retry_after_s))

    def fail_all(self, error: BaseException) -> None:
        """End every request this ingress waits on with `error` (its stream sends it as an event)."""
        for queue in list(self._queues.values()):
            queue.put(error)

    def met(self, replica_id: str, core_channel: tuple[str, int, str] | None = None) -> None:
        if self.open_call is None or replica_id in self._tasks \
                or time.monotonic() < self._retry_at.get(replica_id, 0.0):
            return
        pump = self._pump_core(replica_id, core_channel) if core_channel else self._pump(replica_id)
        # A context of its own: the channel outlives the request that met the replica, and must not
        # share its Ray Serve request id (nor be cancelled with it).
        self._tasks[replica_id] = asyncio.get_running_loop().create_task(
            pump, context=contextvars.Context())

    def _deliver(self, batch: list[tuple]) -> None:
        """A channel's batch of outputs (`RequestOutput.wire()`: the request id first) to the
        queues of the requests still waiting."""
        queues, from_wire = self._queues, RequestOutput.from_wire
        for values in batch:
            queue = queues.get(values[0])
            if queue is not None:
                queue.put(from_wire(values))

    def _fail(self, failures: list[tuple[str, BaseException]]) -> None:
        """The errors of requests sent on a core channel, as their clients should see them (a
        refusal as it is: the request goes elsewhere)."""
        for request_id, exc in failures:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put(exc if isinstance(exc, core_wire.CoreRefused)
                          else map_replica_error(exc, self.retry_after_s, _no_replica))

    async def _pump_core(self, replica_id: str, address: tuple[str, int, str]) -> None:
        """The channel straight to the replica's engine core (`replicas/core_channels.py`); where
        it cannot be reached, a Ray call to the replica instead."""
        host, port, token = address
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    CHANNEL_OPEN_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            logger.debug("engine core of replica %s unreachable (%r): channel by Ray",
                         replica_id, exc)
            return await self._pump(replica_id)
        cpu_binding.keep_off_engine_cpus()  # this ingress carries the core's tokens: not on its CPUs
        self._carries_core = True
        link = None
        try:
            writer.write(core_wire.channel_hello(token, self.channel_id))
            link = self.links[replica_id] = CoreLink(replica_id, writer)
            frames = core_wire.FrameReader()
            while data := await reader.read(CORE_READ_SIZE):
                for _, batch, failures, step_report in frames.feed(data):
                    self._deliver(batch)
                    if failures:
                        self._fail(failures)
                    if step_report is not None:
                        self.dispatch.observe_step(replica_id, batch, step_report, self._call_of)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the requests' own calls report the failure
            logger.debug("output channel to the core of replica %s ended: %r", replica_id, exc)
        finally:
            self._retry_at[replica_id] = time.monotonic() + CHANNEL_RETRY_S
            self._tasks.pop(replica_id, None)
            writer.close()
            if link is not None:
                link.closed = True
                if self.links.get(replica_id) is link:
                    del self.links[replica_id]
                # Those sent on it have no Ray call to report the loss: fail them here.
                self._fail([(request_id, errors.unavailable(
                    "the engine replica serving this request went away", self.retry_after_s))
                    for request_id in link.requests])

    async def _pump(self, replica_id: str) -> None:
        generator = None
        try:
            generator = self.open_call(ChannelRequest(replica_id, self.channel_id))
            await asyncio.wait_for(generator.__anext__(), CHANNEL_OPEN_TIMEOUT_S)
            async for batch in generator:
                self._deliver(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the requests' own calls report the failure
            logger.debug("output channel to replica %s ended: %r", replica_id, exc)
            self._retry_at[replica_id] = time.monotonic() + CHANNEL_RETRY_S
        finally:
            self._tasks.pop(replica_id, None)
            if generator is not None:
                asyncio.get_running_loop().run_in_executor(None, _cancel_quietly, generator)


class ReplicaStream:
    """One replica call: `prime()` sends it and waits for the first output, so errors (a full
    queue, a bad request) surface before a response starts; iteration yields its outputs,
    several pending deltas folded into one when the consumer is behind."""

    def __init__(self, send: Callable[[], Any], map_error: Callable[[BaseException], BaseException],
                 channels: OutputChannels, request_id: str, pacer: StreamPacer | None = None,
                 request: GenerateRequest | None = None, text: StreamText | None = None):
        self.send = send  # returns a DeploymentResponseGenerator
        self.request = request  # set: try the cores' channels first (`core_dispatch.py`)
        self.dispatched: Dispatched | None = None  # the core channel that took it
        self.generator = None
        self.map_error = map_error
        self.channels = channels
        self.request_id = request_id
        self.queue = channels.register(request_id)
        self.first: RequestOutput | None = None
        self.first_delta_time: float | None = None
        self.finished = False
        self.call_id: str | None = None  # Ray Serve's internal request id of the call
        self._pump_task: asyncio.Task | None = None  # held: the loop keeps only weak references
        self.pacer = pacer or StreamPacer(0)
        self.text = text  # set: the engine sends token ids, the text is made here

    async def prime(self) -> None:
        try:
            if self.request is not None:
                self.first = await self._prime_on_channels()
            if self.first is None:
                self.call_id = _own_call_id()
                self.generator = self.send()
                self.channels.track(self.call_id, self.request_id)
                self._pump_task = asyncio.get_running_loop().create_task(self._pump())
                self.first = await self.queue.get()
        except BaseException as exc:
            self.cancel()
            raise self.map_error(exc) from None
        self.first_delta_time = time.monotonic()
        self.channels.dispatch.first_output(self.request_id if self.dispatched is not None
                                            else self.call_id)

    async def _prime_on_channels(self) -> RequestOutput | None:
        """The first output of the request sent on a core's channel; None where no core with a
        channel here took it (then it goes by Ray)."""
        for dispatched in self.channels.dispatch.sends(self.request):
            self.dispatched = dispatched
            try:
                return await self.queue.get()
            except core_wire.CoreRefused:
                dispatched.refused(self.request_id)
                self.dispatched = None
                self.queue = self.channels.register(self.request_id)
        return None

    async def _pump(self) -> None:
        """The call's own stream: outputs (a replica without this ingress's channel), or nothing
        but its end (the outputs come by the channel); its errors either way."""
        try:
            async for item in self.generator:
                if isinstance(item, ReplicaHello):
                    self.channels.met(item.replica_id, item.core_channel)
                else:
                    self.queue.put(item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            if not self.finished:
                self.queue.put(self.map_error(exc))

    def cancel(self) -> None:
        """Abort the replica call. Never blocks the event loop: cancelling a call that has not
        reached a replica yet waits for its assignment, so that happens in a thread."""
        if self.finished:
            return
        self.finished = True
        self.channels.unregister(self.request_id, self.call_id)
        if self.dispatched is not None:
            self.dispatched.ended(self.request_id, aborted=True)
        if self.generator is None:
            return
        if self.first_delta_time is not None:
            _cancel_quietly(self.generator)
        else:
            asyncio.get_running_loop().run_in_executor(None, _cancel_quietly, self.generator)

    def _done(self) -> None:
        self.finished = True
        self.channels.unregister(self.request_id, self.call_id)
        if self.dispatched is not None:
            self.dispatched.ended(self.request_id, aborted=False)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        output, self.first = self.first, None
        pacer = self.pacer
        text = self.text
        pacer.num_streams += 1
        try:
            while True:
                sent = time.monotonic()
                if text is not None:
                    text.fill(output)
                yield output
                pacer.sent()
                if output.finished:
                    self._done()
                    return
                try:
                    output = await self.queue.get()
                    wait = pacer.interval_s() - (time.monotonic() - sent)
                    if wait > 0 and not output.finished:
                        await asyncio.sleep(wait)
                        later = self.queue.get_nowait()
                        if later is not None:
                            output.add(later)
                except Exception:  # the call failed: nothing is left to cancel
                    self._done()
                    raise
        finally:  # a consumer that left early still has to cancel() the call
            pacer.num_streams -= 1


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
    if isinstance(cause, StepFailed):  # this request's step failed; the engine serves on
        return OpenAIError(str(cause), 500, code="engine_step_failed")
    if isinstance(cause, ChannelClosed):  # its ingress's channel broke while the replica serves on
        return errors.unavailable(f"the output channel failed: {cause}", retry_after_s)
    if isinstance(cause, EngineReplicaDead):
        mark_dead(cause.replica_id)
        return errors.unavailable(f"the engine failed: {cause}", retry_after_s)
    if isinstance(cause, (RayActorError, DeploymentUnavailableError)):
        return errors.unavailable("no engine replica is available", retry_after_s)
    if isinstance(cause, ValueError):  # the engine rejected the request
        return errors.bad_request(str(cause), getattr(cause, "param", None))
    logger.error("unexpected error from an engine replica: %r", exc)
    return errors.internal_error(cause)


def _own_call_id() -> str:
    """The internal request id Ray Serve will give the call this task makes next. Behind Ray
    Serve's proxy the request has one; on the ingress's own HTTP server it has none (a handle
    would draw a fresh one we could not know), so it gets one here."""
    import dataclasses

    from ray.serve import context
    current = context._get_serve_request_context()
    if not current._internal_request_id:
        context._serve_request_context.set(dataclasses.replace(
            current, _internal_request_id=uuid.uuid4().hex))
    return context._get_serve_request_context()._internal_request_id


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
            parent, _internal_request_id=f"{parent._internal_request_id or uuid.uuid4().hex}-{index}"))
        return send()  # in prime()'s own task, so the new id stays with this call
    return call


def _no_replica(replica_id: str) -> None:
    """A core channel's errors name no replica to mark dead: Ray reports its death."""


def _cancel_quietly(generator) -> None:
    try:
        generator.cancel()
    except Exception:  # noqa: BLE001 - it failed or finished already: nothing left to cancel
        pass


async def merge_streams(streams: list[ReplicaStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
