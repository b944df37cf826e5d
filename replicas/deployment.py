"""EngineReplica: the thin Ray Serve shim around one AsyncEngine.

The engine knows nothing of Ray; this class only hands its delta outputs to the wire (a request's
own stream, or an ingress's output channel: `replicas/output_channel.py`), reports stats and
health, and exports the engine's gauges as Ray metrics. It is a
plain class: `serve_app/app.py` wraps it with `serve.deployment` and binds it.

The ingress calls `generate(GenerateRequest)` with `handle.options(stream=True)`. A request
router sees the same `GenerateRequest` as `pending_request.args[0]` and can read its
`block_hashes` (the prompt's prefix-cache hash chain). Embeddings are one plain call,
`embed(EmbedRequest)`, to an encoder model's `AsyncEncoderEngine` (chosen here when the checkpoint
is an encoder) or to a decoder's `AsyncEngine` run with `pooling`. Routing and autoscaling stats
(`record_routing_stats`, `record_autoscaling_stats`) belong on this class too.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import pickle
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from replicas import cache_digest, cpu_binding
from replicas.config import EngineConfig
from replicas.embedding_model import uses_encoder
from replicas.engine_core_client import DeliveredOnChannel
from replicas.output_channel import ChannelClosed, OutputChannel
from replicas.outputs import RequestOutput
from replicas.readiness_probe import ReadinessProbe
from replicas.replica_metrics import ReplicaMetrics
from replicas.sampling_params import ParamError, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

METRICS_INTERVAL_S = 1.0
# An output channel without requests for this long ends (a draining replica waits for it).
CHANNEL_IDLE_TIMEOUT_S = 2.0
# Of the shutdown budget, kept for stopping the core once its requests have drained.
DRAIN_MARGIN_S = 1.0


@dataclass(slots=True)
class GenerateRequest:
    """One prompt to generate from, as the ingress sends it (already tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    block_hashes: list[int] = field(default_factory=list)  # for a prefix-aware request router
    channel_id: str | None = None  # the ingress's output channel, where this replica has it open
    priority: int = 0  # under scheduling_policy=priority: lower is served first


@dataclass(slots=True)
class EmbedRequest:
    """Texts to embed, as the ingress sends them (already tokenized and checked)."""

    request_id: str
    prompt_token_ids: list[list[int]]


@dataclass(slots=True)
class ChannelRequest:
    """Open an output channel from one ingress replica on one engine replica: the request router
    sends it to exactly `replica_id`."""

    replica_id: str
    channel_id: str


@dataclass(slots=True, frozen=True)
class ReplicaHello:
    """First item of a request streamed on its own call: names the replica, so the ingress
    can open a channel to it for later requests: straight to its engine core where it has one
    (`core_channel`: host, port, token; `replicas/core_channels.py`), else a Ray call."""

    replica_id: str
    core_channel: tuple[str, int, str] | None = None


class EngineReplicaDead(RuntimeError):
    """Raised by a replica whose engine loop has died; names the replica so the ingress can
    report it unhealthy until Ray Serve has replaced it."""

    def __init__(self, replica_id: str, message: str):
        super().__init__(f"engine replica {replica_id} is dead: {message}")
        self.replica_id = replica_id
        self.reason = message

    def __reduce__(self):
        return (EngineReplicaDead, (self.replica_id, self.reason))


def import_attr(path: str) -> Any:
    """"package.module:Name" (or "package.module.Name") -> the object."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _max_ongoing_requests() -> int | None:
    """This deployment's max_ongoing_requests, as Ray Serve applies it now (None outside Serve)."""
    try:
        from ray import serve
        return serve.get_replica_context()._deployment_config.max_ongoing_requests
    except Exception:  # outside a Serve replica (unit tests, local use)
        return None


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _replica_id() -> str:
    try:
        from ray import serve
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (unit tests, local use)
        return "local"


class EngineReplica:
    """One engine per replica. `engine_class` injects another engine (tests, custom engines);
    by default a decoder's engine steps in a process of its own (`engine_process`, see
    `replicas/engine_core.py`) unless it spans tensor-parallel ranks, which Ray places with the
    replica; ingress replicas' output channels then connect to that process (`core_channels`)."""

    async def __init__(self, engine_config: EngineConfig | dict, engine_class: str | type | None = None,
                       stall_timeout_s: float = 120.0, probe_interval_s: float = 10.0,
                       engine_process: bool = True, core_channels: bool = True):
        config = EngineConfig.model_validate(engine_config)
        if isinstance(engine_class, str):
            engine_class = import_attr(engine_class)
        if engine_class is None and uses_encoder(config.model):  # an embedding model
            from replicas.async_encoder import AsyncEncoderEngine
            engine_class = AsyncEncoderEngine
        if engine_class is None and engine_process and config.tensor_parallel_size == 1:
            from replicas.engine_core_client import EngineCoreClient
            engine_class = EngineCoreClient
        if engine_class is None:
            from replicas.async_engine import AsyncEngine
            engine_class = AsyncEngine
        self.engine = engine_class(config)
        self._stopping = False  # __del__ has run (Ray Serve calls it, then the collector)
        # This process carries an engine core's tokens: off the CPUs the cores run on (the core
        # bound itself before it was ready).
        cpu_binding.keep_off_engine_cpus()
        self.config = config
        self.replica_id = _replica_id()
        self.stall_timeout_s = stall_timeout_s
        self._last_steps = -1
        self._last_progress = time.monotonic()
        self._channels: dict[str, OutputChannel] = {}  # by channel id (one per ingress replica)
        self._channel_requests: dict[OutputChannel, dict[str, asyncio.Future]] = {}
        self._metrics = ReplicaMetrics(self.replica_id)
        self.core_channel = None  # where ingress replicas connect to the engine core
        self._max_ongoing_requests = _max_ongoing_requests()
        if core_channels and hasattr(self.engine, "open_channels"):
            import ray
            self.core_channel = await self.engine.open_channels(ray.util.get_node_ip_address(),
                                                                self._max_ongoing_requests)
        loop = asyncio.get_running_loop()
        self._metrics_task = loop.create_task(self._export_metrics())
        self._probe_task = loop.create_task(ReadinessProbe(self.engine, probe_interval_s).run())

    # -- serving ------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput | ReplicaHello]:
        """A request's outputs: deltas, or only the last one (FINAL_ONLY). ValueError (a bad
        request) is raised before anything is yielded; leaving early, a cancel or a client
        disconnect aborts the request and frees its KV blocks. Where the request's output channel
        is open here, its outputs go there and this call yields nothing, ending when the request
        has finished."""
        params = request.params
        if params.output_kind is RequestOutputKind.CUMULATIVE:  # the wire carries deltas only
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        prompt = {"prompt": request.prompt, "prompt_token_ids": request.prompt_token_ids,
                  "block_hashes": request.block_hashes or None}
        channel = self._channels.get(request.channel_id) if request.channel_id else None
        try:
            if channel is None:
                # To the core's channel where this ingress has connected it (nothing streams
                # here then: the call ends with DeliveredOnChannel), else on this call.
                routing = ({"channel_id": request.channel_id}
                           if request.channel_id and self.core_channel else {})
                stream = self.engine.generate(prompt, params, request.request_id, request.priority,
                                              **routing)
                try:
                    first = True
                    async for out in stream:
                        if first and request.channel_id:
                            yield ReplicaHello(self.replica_id, self.core_channel)
                        first = False
                        yield out
                except DeliveredOnChannel:
                    return
                finally:
                    await stream.aclose()  # a no-op after the end; otherwise aborts in the engine
            else:
                await self._generate_into(channel, request.request_id, prompt, params,
                                          request.priority)
        except Exception as exc:
            if not self.engine.is_healthy():
                raise EngineReplicaDead(self.replica_id, str(exc)) from None
            raise

    async def _generate_into(self, channel: OutputChannel, request_id: str, prompt, params,
                             priority: int) -> None:
        done = asyncio.get_running_loop().create_future()

        def deliver(item: RequestOutput | BaseException) -> None:
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
                return
            channel.put(item)
            if item.finished:
                done.set_result(None)

        channel.attach(request_id)
        self._channel_requests.setdefault(channel, {})[request_id] = done
        try:
            self.engine.add_request(request_id, prompt, params, deliver, priority)
            await done
        finally:
            self._channel_requests.get(channel, {}).pop(request_id, None)
            channel.detach(request_id)
            finished = done.done() and not done.cancelled() and done.exception() is None
            if not finished:  # cancelled, or its channel closed: stop it, free its blocks
                self.engine.abort_nowait(request_id)

    async def open_channel(self, request: ChannelRequest) -> AsyncIterator[list[tuple]]:
        """The ingress's output channel on this replica: an empty batch once it is open, then
        lists of outputs of the requests that name it (`RequestOutput.wire()`), one list per
        engine step at most."""
        if request.replica_id != self.replica_id:  # a router that does not pin channels
            raise ValueError(f"channel for replica {request.replica_id} reached {self.replica_id}")
        old = self._channels.pop(request.channel_id, None)
        if old is not None:
            old.close()
        channel = self._channels[request.channel_id] = OutputChannel(CHANNEL_IDLE_TIMEOUT_S)
        try:
            yield []
            async for batch in channel.batches():
                yield [output.wire() for output in batch]
        finally:
            channel.close()
            if self._channels.get(request.channel_id) is channel:
                del self._channels[request.channel_id]
            # The ingress is gone: so are the streams its requests here were feeding.
            for done in self._channel_requests.pop(channel, {}).values():
                if not done.done():
                    done.set_exception(ChannelClosed("the output channel closed"))

    def model_info(self) -> dict:
        """What the ingress needs to validate and tokenize without loading a model."""
        tokenizer = self.engine.tokenizer
        return {
            "model_name": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "block_size": self.engine.block_size,
            "vocab_size": getattr(self.engine, "vocab_size", None) or len(tokenizer),
            "max_logprobs": self.config.max_logprobs,
            "tasks": list(getattr(self.engine, "tasks", ("generate",))),  # "generate", "embed"
            "tokenizer": pickle.dumps(tokenizer),  # unpickled off the ingress's event loop
        }

    async def embed(self, request: EmbedRequest):
        """The request's embeddings, float32 [len(prompt_token_ids), hidden] (a numpy array);
        ValueError (a ParamError naming `input`) for a bad input or a model that cannot embed."""
        embed = getattr(self.engine, "embed", None)
        if embed is None or "embed" not in getattr(self.engine, "tasks", ()):
            raise ParamError("model", f"the model {self.engine.model_name} does not serve embeddings")
        try:
            return await embed(request.prompt_token_ids)
        except Exception as exc:
            if not self.engine.is_healthy():
                raise EngineReplicaDead(self.replica_id, str(exc)) from None
            raise

    def stats(self) -> dict:
        return {**self.engine.stats(), "replica_id": self.replica_id}

    # -- routing and autoscaling signals ------------------------------------------------------
    async def record_routing_stats(self, snapshot: bool = False) -> dict:
        """Ray Serve polls this (about once a second) for the request router: the queue depth and
        the KV-cache events of the last few seconds, with a full snapshot of the cached block
        hashes when a router may need one to resync. `snapshot=True` (tests, debugging) adds one.
        An engine in its own process makes the report there (`routing_report`)."""
        remote = getattr(self.engine, "routing_report", None)
        if remote is not None:
            await self._follow_max_ongoing_requests()
            return {**await remote(force_snapshot=snapshot), "replica_id": self.replica_id}
        reporter = getattr(self, "_routing_reporter", None)
        if reporter is None:  # made on first use: it is this method's state alone
            reporter = self._routing_reporter = cache_digest.RoutingReporter(self.engine)
        return {**reporter.report(force_snapshot=snapshot), "replica_id": self.replica_id}

    async def _follow_max_ongoing_requests(self) -> None:
        """A lightweight update of the deployment may change max_ongoing_requests: the core
        applies it to the requests ingresses send it on their channels."""
        limit = _max_ongoing_requests()
        if self.core_channel is not None and limit != self._max_ongoing_requests:
            await self.engine.set_max_ongoing_requests(limit)
            self._max_ongoing_requests = limit

    def record_autoscaling_stats(self) -> dict:
        """Ray Serve window-averages this for the autoscaling policy (`queue_depth`)."""
        return cache_digest.autoscaling_stats(self.engine)

    # -- health -------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (restarted)."""
        if not self.engine.is_healthy():
            raise RuntimeError("the engine loop is not running")
        inner = getattr(self.engine, "engine", None)
        if hasattr(inner, "check_health"):  # its tensor-parallel ranks: one gone fails it all
            inner.check_health()
        stats = self.engine.stats()
        now = time.monotonic()
        busy = stats.get("num_waiting", 0) + stats.get("num_running", 0) > 0
        if not busy or stats.get("num_steps") != self._last_steps:
            self._last_steps, self._last_progress = stats.get("num_steps"), now
        elif now - self._last_progress > self.stall_timeout_s:
            raise RuntimeError(f"the engine has work but has not stepped for "
                               f"{now - self._last_progress:.0f} s")
        # Cores that came or went since this process last moved (a scale change): follow them.
        cpu_binding.keep_off_engine_cpus()

    async def _export_metrics(self) -> None:
        while True:
            try:
                self._metrics.update(self.engine.stats())
            except Exception:  # metrics must never take a replica down
                logger.debug("metrics export failed", exc_info=True)
            await asyncio.sleep(METRICS_INTERVAL_S)

    def __del__(self):
        """Ray Serve's shutdown, after its own drain of the calls (it awaits what this returns):
        requests that ingresses sent the core on their channels were no calls of Ray's, so they
        drain here first. Anywhere else (the garbage collector), it stops at once."""
        if getattr(self, "_stopping", True):  # stopped already, or __init__ never ran
            return None
        self._stopping = True
        if getattr(self.engine, "drain", None) is not None and getattr(self, "core_channel", None) \
                and self.engine.is_healthy() and _in_event_loop():
            return self._drain_and_shutdown()
        self.shutdown()
        return None

    async def _drain_and_shutdown(self) -> None:
        from ray import serve
        config = serve.get_replica_context()._deployment_config
        # Ray Serve's drain took at least one of its wait loops of the budget.
        left_s = config.graceful_shutdown_timeout_s - config.graceful_shutdown_wait_loop_s
        try:
            if not await self.engine.drain(max(0.0, left_s - DRAIN_MARGIN_S)):
                logger.warning("engine replica %s stopped with requests still running",
                               self.replica_id)
        except Exception:  # noqa: BLE001 - the core is gone: nothing left to drain
            logger.debug("drain failed", exc_info=True)
        self.shutdown()

    def shutdown(self) -> None:
        for name in ("_metrics_task", "_probe_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        shutdown = getattr(getattr(self, "engine", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        inner_shutdown = getattr(getattr(getattr(self, "engine", None), "engine", None), "shutdown", None)
        if inner_shutdown is not None:  # its tensor-parallel ranks
            inner_shutdown()
