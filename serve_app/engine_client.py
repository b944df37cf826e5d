"""EngineClient: the ingress's one way to the engine cores.

The client keeps a `CoreLink` to every core its directory lists (`serve_app/core_directory.py`),
and owns the router (`RouterState`): each core's routing digest and step reports arrive on its
link and feed it directly. A request is sent to the first core of its ranking that is connected
and takes it; a core at its limit (or draining) refuses, and the request goes down the ranking.
When every core refuses, the request waits in this ingress's one admission queue, first come
first served, and past `max_queued_requests` it is answered 429. A request whose core goes away
before its first output is sent again elsewhere; one that had started streaming ends with 503.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Awaitable, Callable

import numpy as np

from pagedserve.replicas.core.block_hash import block_hashes
from pagedserve.replicas.core.lora_request import LoRARequest, adapter_root_hash
from pagedserve.replicas.engine import cpu_binding, protocol
from pagedserve.serve_app import errors
from pagedserve.serve_app.core_link import CoreLink
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.routing.metrics import RoutingMetrics
from pagedserve.serve_app.routing.policy import RoutingSettings
from pagedserve.serve_app.routing.router_state import RouterState
from pagedserve.serve_app.request_stream import Refused, RequestStream
from pagedserve.serve_app.stream_pacer import StreamPacer
from pagedserve.serve_app.stream_text import StreamText

logger = logging.getLogger(__name__)

WATCH_RETRY_S = 1.0  # after the directory failed to answer
RECONNECT_S = 1.0  # after a link to a listed core failed
ADMISSION_POLL_S = 0.05  # the head of the queue retries this often (room freed elsewhere)
QUEUED_REPORT_S = 0.5  # how often the cores hear of the requests waiting here for them
# Before any core has connected (the ingress just started), a request waits this long for one.
NO_CORE_WAIT_S = 30.0
ADAPTER_LOAD_WAIT_S = 120.0  # a core reads and checks an adapter for a load request within this
# With none up and scale from zero on, this long: the autoscaler's delay, then a replica's start.
COLD_START_WAIT_S = 120.0


class EngineClient:
    def __init__(self, directory, routing: RoutingSettings, max_queued_requests: int,
                 retry_after_s: int, metrics: RoutingMetrics | None = None,
                 on_replica_lost: Callable[[str], None] | None = None,
                 ask_for_replica: Callable[[], Awaitable] | None = None,
                 on_adapters: Callable[[dict[str, list]], Awaitable] | None = None):
        self.directory = directory  # a handle to the CoreDirectory deployment
        self.client_id = uuid.uuid4().hex
        self.router = RouterState(routing)
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.retry_after_s = retry_after_s
        self.on_replica_lost = on_replica_lost or (lambda replica_id: None)
        self.links: dict[str, CoreLink] = {}
        self.live_ids: tuple[str, ...] = ()  # the usable links' replicas, for the router
        self.last_generation: dict[str, float | None] = {}  # per core, from its digests
        self.waiting: collections.deque[RequestStream] = collections.deque()
        self.no_core_wait_s = NO_CORE_WAIT_S
        # min_replicas=0: with no core up a request waits for one, and asks for it (below).
        self.scale_from_zero = False
        self.cold_start_wait_s = COLD_START_WAIT_S
        self.ask_for_replica = ask_for_replica
        self._asking: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._version = -1
        # The directory's LoRA adapters, each time it lists them (serve_app/adapters.py).
        self.on_adapters = on_adapters or _ignore_adapters
        # LoadAdapter sent and not answered: request id -> (its answer, the link it went on)
        self._adapter_loads: dict[str, tuple[asyncio.Future, CoreLink]] = {}
        self._connected = asyncio.Event()
        self._ever_connected = False

    def configure_router(self, routing: RoutingSettings) -> None:
        """New settings, a new router (the cores' next digests fill it again)."""
        if routing != self.router.settings:
            self.router = RouterState(routing)
            self.router.retain(self.live_ids)

    def start(self) -> None:
        self._spawn(self._watch())
        self._spawn(self._report_queued())

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- which cores there are --------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            try:
                self._version, entries, adapters = await self.directory.watch.remote(self._version)
            except Exception as exc:  # noqa: BLE001 - restarting: keep the links we have
                logger.debug("core directory unavailable: %r", exc)
                await asyncio.sleep(WATCH_RETRY_S)
                continue
            self._reconcile({replica_id: tuple(address) for replica_id, address in entries.items()})
            await self.on_adapters(adapters)

    def _reconcile(self, entries: dict[str, tuple[str, int, str]]) -> None:
        for replica_id, link in list(self.links.items()):
            if replica_id not in entries or link.address != entries[replica_id]:
                link.withdrawn = True
                if not link.requests:
                    link.close()
        for replica_id, address in entries.items():
            link = self.links.get(replica_id)
            if link is None or link.address != address:
                self._connect(CoreLink(replica_id, address))
            elif link.withdrawn and not link.closed:  # listed again (a restarted directory)
                link.withdrawn = False
        self._update_live()

    def _connect(self, link: CoreLink) -> None:
        self.links[link.replica_id] = link
        self._spawn(link.run(self))

    def link_usable(self, link: CoreLink) -> None:
        # This process carries the cores' traffic: off the CPUs they claimed (one just came).
        cpu_binding.keep_off_engine_cpus()
        self._update_live()
        self._wake_waiting()

    def link_closed(self, link: CoreLink) -> None:
        if self.links.get(link.replica_id) is link:
            del self.links[link.replica_id]
            if not link.withdrawn:
                if not link.draining and link.connected:
                    self.on_replica_lost(link.replica_id)
                self._spawn(self._reconnect(link))
        self._update_live()
        for stream in list(link.requests.values()):
            stream.lost()
        for request_id, (future, sent_on) in list(self._adapter_loads.items()):
            if sent_on is link and not future.done():  # its answer will not come
                future.set_exception(errors.unavailable(
                    "the engine replica checking the adapter went away; retry", self.retry_after_s))

    async def _reconnect(self, link: CoreLink) -> None:
        """A core still listed whose link failed: try it again (the listing goes once its
        replica is gone)."""
        await asyncio.sleep(RECONNECT_S)
        if link.replica_id not in self.links and not link.withdrawn:
            self._connect(CoreLink(link.replica_id, link.address))

    def _update_live(self) -> None:
        live = tuple(replica_id for replica_id, link in self.links.items() if link.usable)
        if live != self.live_ids:
            self.live_ids = live
            self.router.retain(live)
            for replica_id in [r for r in self.last_generation if r not in self.links]:
                del self.last_generation[replica_id]
        if live:
            self._connected.set()
            self._ever_connected = True
        else:
            self._connected.clear()

    # -- what the cores send ----------------------------------------------------------------------
    def on_message(self, link: CoreLink, message: protocol.CoreOutputs | protocol.AdapterLoaded
                   ) -> None:
        if isinstance(message, protocol.AdapterLoaded):
            future, _ = self._adapter_loads.pop(message.request_id, (None, None))
            if future is not None and not future.done():
                future.set_result(message.error)
            return
        requests = link.requests
        ids, finished = [], []
        for output in message.outputs:
            request_id = output.request_id
            ids.append(request_id)
            if output.finished:
                finished.append(request_id)
            stream = requests.pop(request_id, None) if output.finished else requests.get(request_id)
            if stream is not None:
                stream.queue.put(output)
        for failure in message.failures:
            stream = requests.pop(failure.request_id, None)
            if stream is not None:
                stream.queue.put(self._error(failure))
        if message.report is not None:
            self.router.observe_step(link.replica_id, ids, finished, message.report)
        if message.digest is not None and self.router.observe(link.replica_id, message.digest):
            self.last_generation[link.replica_id] = message.digest.get("last_generation_time")
            if self.metrics is not None:
                self.metrics.record_load(link.replica_id, self.router.load(link.replica_id))
        if message.draining and not link.draining:
            link.draining = True
            self._update_live()
        if message.failures or finished:
            self._wake_waiting()

    def _error(self, failure: protocol.Failure) -> BaseException:
        if failure.kind == protocol.REFUSED:
            return Refused(failure.message)
        if failure.kind == protocol.INVALID:
            return errors.bad_request(failure.message, failure.param)
        if failure.kind == protocol.STEP_FAILED:
            return OpenAIError(failure.message, 500, code="engine_step_failed")
        return errors.internal_error(RuntimeError(failure.message))

    # -- sending ----------------------------------------------------------------------------------
    def stream(self, request: protocol.AddRequest, text: StreamText | None = None,
               pacer: StreamPacer | None = None) -> RequestStream:
        return RequestStream(self, request, text, pacer)

    def place(self, stream: RequestStream, tried: set[str]) -> CoreLink | None:
        """Send the request to the best core it has not tried; None when none is left."""
        hashes = stream.request.block_hashes or []
        lora = stream.request.lora
        adapter_id = lora.lora_int_id if lora is not None else 0
        decision = self.router.choose(None, hashes, self.live_ids, adapter_id) if self.live_ids else None
        if decision is None:
            return None
        stream.first_choice = decision.replica_id
        for replica_id in decision.ranking():
            link = self.links.get(replica_id)
            if replica_id in tried or link is None or not link.usable:
                continue
            reason, stream.sent_at = self.router.dispatched(stream.request_id, replica_id, hashes,
                                                            decision, adapter_id)
            if self.metrics is not None:
                self.metrics.record_decision(reason)
            link.add(stream)
            return link
        return None

    async def admit(self, stream: RequestStream, front: bool = False) -> None:
        """Wait in the admission queue until it is this request's turn and room may have freed
        (the caller then tries the cores again). `front`: a request whose turn it was, refused
        after all, keeps its place at the head."""
        if not stream.queued:
            if not front and 0 <= self.max_queued_requests <= len(self.waiting):
                raise errors.overloaded(self.retry_after_s)
            self.waiting.appendleft(stream) if front else self.waiting.append(stream)
            stream.queued = True
        stream.wake = asyncio.get_running_loop().create_future()
        try:
            if not self.live_ids:
                connecting = any(not link.connected for link in self.links.values())
                wait_s = self.no_core_wait_s
                if self.scale_from_zero:
                    self._ask_for_replica()
                    wait_s = self.cold_start_wait_s
                elif self._ever_connected and not connecting:  # all gone: Ray Serve replaces them
                    raise errors.unavailable("no engine replica is available",
                                             self.retry_after_s)
                try:
                    await asyncio.wait_for(self._connected.wait(), wait_s)
                except asyncio.TimeoutError:
                    raise errors.unavailable("no engine replica is available",
                                             self.retry_after_s) from None
            elif self.waiting[0] is stream:
                await asyncio.wait_for(asyncio.shield(stream.wake), ADMISSION_POLL_S)
            else:
                await stream.wake
        except asyncio.TimeoutError:
            pass

    def _ask_for_replica(self) -> None:
        """No core is up: one call through the replica deployment's handle waits in that handle's
        queue until a replica runs, and Ray Serve's autoscaler counts it as demand (the
        replicas' own stats, the usual signal, need a replica)."""
        if self.ask_for_replica is not None and self._asking is None:
            self._asking = self._spawn(self._ask())

    async def _ask(self) -> None:
        try:
            await self.ask_for_replica()
        except Exception as exc:  # noqa: BLE001 - the next waiting request asks again
            logger.debug("asking for an engine replica failed: %r", exc)
        finally:
            self._asking = None

    def leave_queue(self, stream: RequestStream) -> None:
        if stream.queued:
            stream.queued = False
            self.waiting.remove(stream)
            self._wake_waiting()

    def _wake_waiting(self) -> None:
        if self.waiting:
            wake = self.waiting[0].wake
            if wake is not None and not wake.done():
                wake.set_result(None)

    async def _report_queued(self) -> None:
        """Each core hears how many requests wait here with it first in their ranking: its
        queue for the autoscaler, which would otherwise see full replicas and no queue."""
        while True:
            await asyncio.sleep(QUEUED_REPORT_S)
            counts = collections.Counter(s.first_choice for s in self.waiting)
            for replica_id, link in self.links.items():
                link.queued(counts.get(replica_id, 0))

    def request_ended(self, stream: RequestStream) -> None:
        self.router.completed(stream.request_id)
        self._wake_waiting()

    # -- LoRA adapters ----------------------------------------------------------------------------
    async def load_adapter(self, lora: LoRARequest) -> str | None:
        """Have the least loaded core read and check the adapter now: None, or why it cannot be
        served. Its requests then go there first; other cores load it when the adapter spreads."""
        live = [self.links[r] for r in self.live_ids if r in self.links]
        if not live:
            raise errors.unavailable("no engine replica is available to check the adapter",
                                     self.retry_after_s)
        request_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        link = min(live, key=lambda link: self.router.load(link.replica_id))
        self._adapter_loads[request_id] = (future, link)
        link.send(protocol.LoadAdapter(request_id, lora))
        self.router.adapter_sent(lora.lora_int_id, link.replica_id)
        try:
            return await asyncio.wait_for(future, ADAPTER_LOAD_WAIT_S)
        except asyncio.TimeoutError:
            raise errors.unavailable("the engine replica did not finish loading the adapter",
                                     self.retry_after_s) from None
        finally:
            self._adapter_loads.pop(request_id, None)

    def unload_adapter(self, lora: LoRARequest) -> None:
        """Every core forgets the adapter (its requests in flight finish with it)."""
        for link in self.links.values():
            if link.connected and not link.closed:
                link.send(protocol.UnloadAdapter(lora.lora_int_id))

    # -- embeddings -------------------------------------------------------------------------------
    async def embed(self, request_id: str, token_ids: list[list[int]], params,
                    lora: LoRARequest | None = None, block_size: int | None = None) -> np.ndarray:
        """One pooling request per input, in order -> float32 [len(token_ids), hidden]; with a
        LoRA adapter, its hidden states (the prompts hashed for routing as the adapter's)."""
        root = adapter_root_hash(lora.lora_int_id) if lora is not None else None
        streams = [self.stream(protocol.AddRequest(
            f"{request_id}-{i}", ids, params, 0,
            block_hashes(ids, block_size, root) if lora is not None and block_size else None, lora))
            for i, ids in enumerate(token_ids)]
        try:
            await asyncio.gather(*(s.prime() for s in streams))
            rows = [s.first.embedding for s in streams]
        finally:
            for s in streams:
                s.cancel()
        return np.asarray(rows, dtype=np.float32).reshape(len(token_ids), -1)

    def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for link in list(self.links.values()):
            link.close()

    def fail_all(self, error: BaseException) -> None:
        """End every request this ingress waits on with `error` (its stream sends it as an event)."""
        for link in list(self.links.values()):
            for stream in list(link.requests.values()):
                stream.queue.put(error)


async def _ignore_adapters(listing: dict[str, list]) -> None:
    pass
