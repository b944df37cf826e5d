"""EngineReplica: the Ray Serve replica that supervises one engine core.

It starts the core (`replicas/engine/core_process.py`), publishes the core's address in the application's
core directory (a handle it is given), and serves Ray Serve's control plane: health checks, the
autoscaling stats, the model's facts for the ingress, metrics, and the drain when Ray Serve stops
it. It carries no tokens: the ingresses connect to the core itself (`replicas/engine/protocol.py`). It is
a plain class: `serve_app/app.py` wraps it with `serve.deployment` and binds it.
"""
from __future__ import annotations

import asyncio
import logging
import time

from pagedserve.replicas.core import cache_digest
from pagedserve.replicas.engine import cpu_binding, protocol
from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.engine.core_process import CoreProcess
from pagedserve.replicas.deployment.metrics import ReplicaMetrics
# The app builder checks a tensor-parallel model through the shim, before any replica starts.
from pagedserve.replicas.parallel.sharding import check_model_splits  # noqa: F401

logger = logging.getLogger(__name__)

METRICS_INTERVAL_S = 1.0
PUBLISH_PERIOD_S = 2.0  # the core directory forgets an address not published again for a while
WITHDRAW_TIMEOUT_S = 2.0
# Of the drain budget, kept for stopping the core once its requests have drained.
DRAIN_MARGIN_S = 1.0


def _replica_id() -> str:
    try:
        from ray import serve
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (unit tests, local use)
        return "local"


def _node_address() -> str:
    import ray
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class EngineReplica:
    """`max_requests`: the most requests its core holds (it refuses more, and the ingress goes to
    the next replica); `drain_s`: how long a stopping replica waits for them. `engine_class`
    ("module:Class") gives the core another engine (tests, custom engines)."""

    async def __init__(self, engine_config: EngineConfig | dict, directory=None, *,
                       max_requests: int | None = None, drain_s: float = 30.0,
                       stall_timeout_s: float = 120.0, probe_interval_s: float = 10.0,
                       engine_process: bool = True, engine_class: str | None = None):
        config = EngineConfig.model_validate(engine_config)
        # Tensor-parallel ranks are placed with this replica by Ray: their core runs here.
        in_process = not engine_process or config.tensor_parallel_size > 1
        start = protocol.Start(config.model_dump(), _node_address(), max_requests,
                               probe_interval_s, engine_class)
        self.core = await asyncio.to_thread(CoreProcess, start, in_process)
        self.core.attach()
        self._stopping = False  # __del__ has run (Ray Serve calls it, then the collector)
        # The core bound itself to its CPUs before it was ready: stay off them.
        cpu_binding.keep_off_engine_cpus()
        self.config = config
        self.replica_id = _replica_id()
        self.directory = directory
        self.drain_s = drain_s
        self.stall_timeout_s = stall_timeout_s
        self._last_steps = -1
        self._last_progress = time.monotonic()
        self.stalled = False
        self._metrics = ReplicaMetrics(self.replica_id)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._export_metrics())]
        if directory is not None:
            self._tasks.append(loop.create_task(self._publish()))

    def model_info(self) -> dict:
        """What the ingress needs to validate and tokenize without loading a model (the tokenizer
        pickled: unpickled off the ingress's event loop)."""
        return {key: value for key, value in self.core.info.items()
                if key not in ("address", "stats")}

    def stats(self) -> dict:
        return {**self.core.stats, "healthy": self.core.is_healthy(), "engine_pid": self.core.pid,
                "replica_id": self.replica_id}

    async def _publish(self) -> None:
        """The core's address in the directory while the core lives (a dead one is withdrawn,
        so the ingresses stop trying it while Ray Serve replaces this replica)."""
        while self.core.is_healthy():
            try:
                await self.directory.publish.remote(self.replica_id, list(self.core.address))
            except Exception:  # noqa: BLE001 - the directory restarts: publish again next time
                logger.debug("could not publish the core's address", exc_info=True)
            await asyncio.sleep(PUBLISH_PERIOD_S)
        await self._withdraw()

    async def _withdraw(self) -> None:
        try:  # the directory may be stopping too: do not wait long
            await asyncio.wait_for(self.directory.withdraw.remote(self.replica_id),
                                   WITHDRAW_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - its entry expires; the core's drain tells ingresses
            logger.debug("could not withdraw the core's address", exc_info=True)

    # -- autoscaling, health, metrics -----------------------------------------------------------
    def record_autoscaling_stats(self) -> dict:
        """Ray Serve window-averages this for the autoscaling policy (`queue_depth`)."""
        return cache_digest.autoscaling_stats(self.core.stats)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (restarted)."""
        self.core.check_health()
        stats = self.core.stats
        now = time.monotonic()
        busy = stats.get("num_waiting", 0) + stats.get("num_running", 0) > 0
        if not busy or stats.get("num_steps") != self._last_steps:
            self._last_steps, self._last_progress = stats.get("num_steps"), now
        elif now - self._last_progress > self.stall_timeout_s:
            self.stalled = True  # nothing to drain when Ray Serve stops it
            raise RuntimeError(f"the engine has work but has not stepped for "
                               f"{now - self._last_progress:.0f} s")
        # Cores that came or went since this process last moved (a scale change): follow them.
        cpu_binding.keep_off_engine_cpus()

    async def _export_metrics(self) -> None:
        while True:
            try:
                self._metrics.update(self.core.stats)
            except Exception:  # metrics must never take a replica down
                logger.debug("metrics export failed", exc_info=True)
            await asyncio.sleep(METRICS_INTERVAL_S)

    # -- stopping -------------------------------------------------------------------------------
    def __del__(self):
        """Ray Serve's shutdown (it awaits what this returns): leave the directory, let the core
        finish what it holds, then stop it. Anywhere else (the garbage collector), stop at once."""
        if getattr(self, "_stopping", True):  # stopped already, or __init__ never ran
            return None
        self._stopping = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.shutdown()
            return None
        return self._drain_and_shutdown()

    async def _drain_and_shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.directory is not None:
            await self._withdraw()
        if self.core.is_healthy() and not self.stalled and not await self.core.drain(
                max(0.0, self.drain_s - DRAIN_MARGIN_S)):
            logger.warning("engine replica %s stopped with requests still running",
                           self.replica_id)
        self.shutdown()

    def shutdown(self) -> None:
        for task in getattr(self, "_tasks", ()):
            task.cancel()
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()
