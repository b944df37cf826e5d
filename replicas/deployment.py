"""EngineReplica: the thin Ray Serve shim around one AsyncEngine.

The engine knows nothing of Ray; this class only turns its cumulative outputs into small deltas
for the wire, reports stats and health, and exports the engine's gauges as Ray metrics. It is a
plain class: `serve_app/app.py` wraps it with `serve.deployment` and binds it.

The ingress calls `generate(GenerateRequest)` with `handle.options(stream=True)`. A request
router sees the same `GenerateRequest` as `pending_request.args[0]` and can read its
`block_hashes` (the prompt's prefix-cache hash chain). Routing and autoscaling stats
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

from replicas import cache_digest
from replicas.config import EngineConfig
from replicas.outputs import PositionLogprobs, RequestOutput
from replicas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Ray metric names exported by every replica (Prometheus sees them with a `ray_` prefix).
REPLICA_GAUGES = {
    "pagedserve_num_requests_waiting": ("num_waiting", "Requests waiting in the engine queue"),
    "pagedserve_num_requests_running": ("num_running", "Sequences running in the engine batch"),
    "pagedserve_kv_cache_usage": ("kv_cache_usage", "Fraction of KV-cache blocks in use"),
    "pagedserve_prefix_cache_hit_rate": ("prefix_cache_hit_rate",
                                         "Prompt tokens served from the prefix cache / queried"),
}
REPLICA_COUNTERS = {
    "pagedserve_num_preemptions": ("num_preemptions", "Sequences preempted (recomputed later)"),
    "pagedserve_engine_steps": ("num_steps", "Engine steps run"),
}
METRICS_INTERVAL_S = 1.0


@dataclass(slots=True)
class GenerateRequest:
    """One prompt to generate from, as the ingress sends it (already tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    block_hashes: list[int] = field(default_factory=list)  # for a prefix-aware request router


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class GenerateDelta:
    """What changed since the previous delta of a request; counts are totals so far."""

    request_id: str
    choices: list[ChoiceDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the first delta only


class DeltaTracker:
    """Turns a request's cumulative outputs into deltas (pure; unit-tested without Ray)."""

    def __init__(self, n: int):
        self.text_sent = [0] * n
        self.tokens_sent = [0] * n
        self.logprobs_sent = [0] * n
        self.finished = [False] * n
        self.first = True

    def delta(self, out: RequestOutput) -> GenerateDelta:
        choices = []
        for c in out.outputs:
            i = c.index
            if self.finished[i]:
                continue
            text = c.text[self.text_sent[i]:] if len(c.text) > self.text_sent[i] else ""
            token_ids = c.token_ids[self.tokens_sent[i]:]
            logprobs = c.logprobs[self.logprobs_sent[i]:] if c.logprobs is not None else None
            if not text and not token_ids and c.finish_reason is None:
                continue
            self.text_sent[i] = max(self.text_sent[i], len(c.text))
            self.tokens_sent[i] = len(c.token_ids)
            self.logprobs_sent[i] = len(c.logprobs) if c.logprobs is not None else 0
            self.finished[i] = c.finish_reason is not None
            choices.append(ChoiceDelta(i, text, list(token_ids), logprobs, c.finish_reason,
                                       c.stop_reason))
        delta = GenerateDelta(out.request_id, choices, len(out.prompt_token_ids),
                              out.num_cached_tokens, out.finished,
                              out.prompt_logprobs if self.first else None)
        self.first = False
        return delta


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


def _replica_id() -> str:
    try:
        from ray import serve
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (unit tests, local use)
        return "local"


class EngineReplica:
    """One engine per replica. `engine_class` injects another engine (tests, custom engines)."""

    async def __init__(self, engine_config: EngineConfig | dict, engine_class: str | type | None = None,
                       stall_timeout_s: float = 120.0):
        config = EngineConfig.model_validate(engine_config)
        if isinstance(engine_class, str):
            engine_class = import_attr(engine_class)
        if engine_class is None:
            from replicas.async_engine import AsyncEngine
            engine_class = AsyncEngine
        self.engine = engine_class(config)
        self.config = config
        self.replica_id = _replica_id()
        self.stall_timeout_s = stall_timeout_s
        self._last_steps = -1
        self._last_progress = time.monotonic()
        self._metrics = _ReplicaMetrics(self.replica_id)
        self._metrics_task = asyncio.get_running_loop().create_task(self._export_metrics())

    # -- serving ------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream deltas. ValueError (a bad request) is raised before the first delta; leaving
        early, a cancel or a client disconnect aborts the request and frees its KV blocks."""
        prompt = {"prompt": request.prompt, "prompt_token_ids": request.prompt_token_ids}
        tracker = DeltaTracker(request.params.n)
        stream = self.engine.generate(prompt, request.params, request.request_id)
        try:
            async for out in stream:
                delta = tracker.delta(out)
                if delta.choices or delta.finished:
                    yield delta
        except Exception as exc:
            if not self.engine.is_healthy():
                raise EngineReplicaDead(self.replica_id, str(exc)) from None
            raise
        finally:
            await stream.aclose()  # a no-op after the end; otherwise aborts in the engine

    def model_info(self) -> dict:
        """What the ingress needs to validate and tokenize without loading a model."""
        inner = getattr(self.engine, "engine", None)
        runner = getattr(inner, "runner", None)
        tokenizer = self.engine.tokenizer
        return {
            "model_name": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "block_size": self.engine.block_size,
            "vocab_size": getattr(runner, "vocab_size", None) or len(tokenizer),
            "max_logprobs": self.config.max_logprobs,
            "tokenizer": pickle.dumps(tokenizer),  # unpickled off the ingress's event loop
        }

    def stats(self) -> dict:
        return {**self.engine.stats(), "replica_id": self.replica_id}

    # -- routing and autoscaling signals ------------------------------------------------------
    def record_routing_stats(self, snapshot: bool = False) -> dict:
        """Ray Serve polls this (about once a second) for the request router: the queue depth and
        the KV-cache events of the last few seconds, with a full snapshot of the cached block
        hashes when a router may need one to resync. `snapshot=True` (tests, debugging) adds one."""
        reporter = getattr(self, "_routing_reporter", None)
        if reporter is None:  # made on first use: it is this method's state alone
            reporter = self._routing_reporter = cache_digest.RoutingReporter(self.engine)
        return {**reporter.report(force_snapshot=snapshot), "replica_id": self.replica_id}

    def record_autoscaling_stats(self) -> dict:
        """Ray Serve window-averages this for the autoscaling policy (`queue_depth`)."""
        return cache_digest.autoscaling_stats(self.engine)

    # -- health -------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (restarted)."""
        if not self.engine.is_healthy():
            raise RuntimeError("the engine loop is not running")
        stats = self.engine.stats()
        now = time.monotonic()
        busy = stats.get("num_waiting", 0) + stats.get("num_running", 0) > 0
        if not busy or stats.get("num_steps") != self._last_steps:
            self._last_steps, self._last_progress = stats.get("num_steps"), now
        elif now - self._last_progress > self.stall_timeout_s:
            raise RuntimeError(f"the engine has work but has not stepped for "
                               f"{now - self._last_progress:.0f} s")

    async def _export_metrics(self) -> None:
        while True:
            try:
                self._metrics.update(self.engine.stats())
            except Exception:  # metrics must never take a replica down
                logger.debug("metrics export failed", exc_info=True)
            await asyncio.sleep(METRICS_INTERVAL_S)

    def __del__(self):
        task = getattr(self, "_metrics_task", None)
        if task is not None:
            task.cancel()
        shutdown = getattr(getattr(self, "engine", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


class _ReplicaMetrics:
    def __init__(self, replica_id: str):
        from ray.util.metrics import Counter, Gauge

        tags = ("replica",)
        self.tags = {"replica": replica_id}
        self.gauges = {key: Gauge(name, description, tag_keys=tags)
                       for name, (key, description) in REPLICA_GAUGES.items()}
        self.counters = {key: Counter(name, description, tag_keys=tags)
                         for name, (key, description) in REPLICA_COUNTERS.items()}
        self.last_counts: dict[str, float] = {}

    def update(self, stats: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.set(float(stats[key]), tags=self.tags)
        for key, counter in self.counters.items():
            if key in stats:
                increase = float(stats[key]) - self.last_counts.get(key, 0.0)
                if increase > 0:
                    counter.inc(increase, tags=self.tags)
                self.last_counts[key] = float(stats[key])
