"""Is every engine replica of this application alive (`check`, liveness: Ray Serve's view,
sharpened by requests), and can the application generate right now (`ready`, readiness)?

Ray Serve replaces a replica whose `check_health` fails a few times in a row; until then its
deployment still counts it as running. A request that meets a dead engine names the replica
(`EngineReplicaDead`), and the application stays unhealthy until that replica's actor is gone.

Readiness asks more than a running process: some engine replica must have sampled a token within
the last `window_s` (idle cores run a one-token probe to keep proving it, `pagedserve.replicas.engine.core`).
The cores report when in the routing digests this ingress receives every second.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from ray import serve

CACHE_S = 0.5
DEAD_REPLICA_MEMORY_S = 300.0


class ReplicaHealth:
    def __init__(self, deployment: str):
        self.deployment = deployment
        self.dead: dict[str, float] = {}  # replica id -> when a request found its engine dead
        self._cached: tuple[float, bool, str] = (float("-inf"), False, "")

    def mark_dead(self, replica_id: str) -> None:
        self.dead[replica_id] = time.monotonic()
        self._cached = (float("-inf"), False, "")

    async def check(self) -> tuple[bool, str]:
        """(healthy, reason)."""
        now = time.monotonic()
        if self.dead:
            names = await asyncio.to_thread(self._replica_actor_names)
            for replica_id, seen in list(self.dead.items()):
                gone = not any(name.endswith(f"#{replica_id}") for name in names)
                if gone or now - seen > DEAD_REPLICA_MEMORY_S:
                    del self.dead[replica_id]
            if self.dead:
                return False, f"engine replica(s) {', '.join(self.dead)} died"
        checked_at, healthy, reason = self._cached
        if now - checked_at < CACHE_S:
            return healthy, reason
        try:
            healthy, reason = await asyncio.to_thread(self._deployment_healthy)
        except Exception as exc:  # noqa: BLE001 - the controller is unreachable: not healthy
            healthy, reason = False, f"cannot read the application status: {exc}"
        self._cached = (time.monotonic(), healthy, reason)
        return healthy, reason

    @staticmethod
    def ready(window_s: float, last_generation: Mapping[str, float | None]) -> tuple[bool, str]:
        """(ready, reason), from when each engine core this ingress reaches last generated."""
        now = time.time()
        recent = [r for r, t in last_generation.items() if t is not None and now - t <= window_s]
        if recent:
            return True, f"{len(recent)} engine replica(s) generated within the last {window_s:g} s"
        return False, f"no engine replica has generated a token in the last {window_s:g} s"

    def _replica_actor_names(self) -> list[str]:
        import ray

        prefix = f"{serve.get_replica_context().app_name}#{self.deployment}#"
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if prefix in a["name"]]

    def _deployment_healthy(self) -> tuple[bool, str]:
        app_name = serve.get_replica_context().app_name
        app = serve.status().applications.get(app_name)
        deployment = app.deployments.get(self.deployment) if app is not None else None
        if deployment is None:
            return False, f"deployment {self.deployment!r} of {app_name!r} not found"
        states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
        status = str(getattr(deployment.status, "value", deployment.status))
        running = states.get("RUNNING", 0)
        if status in ("UNHEALTHY", "DEPLOY_FAILED"):
            return False, f"engine replicas are {status}: {deployment.message}"
        if running == 0:
            return False, "no engine replica is running"
        if states.get("RECOVERING", 0):
            return False, "an engine replica is recovering"
        return True, f"{running} engine replica(s) running"
