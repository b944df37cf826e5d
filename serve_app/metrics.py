"""Metric names, defined once, and the ingress's recorders.

Everything goes through Ray's metrics (`ray.util.metrics`), which every node exports in Prometheus
format on its metrics port with a `ray_` prefix; dashboards read those names. The replica's engine
gauges are defined next to the replica (`replicas/deployment/metrics.py`); `/metrics` on the ingress
gathers every node's export and keeps only `ray_pagedserve_*`.
"""
from __future__ import annotations

import asyncio
import time

from pagedserve.replicas.deployment.metrics import REPLICA_COUNTERS, REPLICA_GAUGES

PREFIX = "pagedserve_"
EXPORT_PREFIX = "ray_" + PREFIX

REQUESTS = "pagedserve_requests"  # counter: endpoint, status_code
PROMPT_TOKENS = "pagedserve_prompt_tokens"  # counter
CACHED_PROMPT_TOKENS = "pagedserve_cached_prompt_tokens"  # counter
GENERATION_TOKENS = "pagedserve_generation_tokens"  # counter
TTFT = "pagedserve_time_to_first_token_seconds"  # histogram
TPOT = "pagedserve_time_per_output_token_seconds"  # histogram
E2E = "pagedserve_e2e_request_latency_seconds"  # histogram
ROUTING_DECISIONS = "pagedserve_routing_decisions"  # counter: reason (for a request router)

LATENCY_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
TOKEN_LATENCY_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0]

ALL_METRICS = sorted([REQUESTS, PROMPT_TOKENS, CACHED_PROMPT_TOKENS, GENERATION_TOKENS, TTFT, TPOT,
                      E2E, ROUTING_DECISIONS, *REPLICA_GAUGES, *REPLICA_COUNTERS])


class IngressMetrics:
    """Per-request recorders; cheap enough to call on every request."""

    def __init__(self):
        from ray.util.metrics import Counter, Histogram

        model = ("model",)
        self.requests = Counter(REQUESTS, "Requests by endpoint and status code",
                                tag_keys=("model", "endpoint", "status_code"))
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens received", tag_keys=model)
        self.cached_prompt_tokens = Counter(CACHED_PROMPT_TOKENS,
                                            "Prompt tokens served from the prefix cache", tag_keys=model)
        self.generation_tokens = Counter(GENERATION_TOKENS, "Tokens generated", tag_keys=model)
        self.ttft = Histogram(TTFT, "Time to first token", boundaries=LATENCY_BUCKETS_S, tag_keys=model)
        self.tpot = Histogram(TPOT, "Time per output token after the first",
                              boundaries=TOKEN_LATENCY_BUCKETS_S, tag_keys=model)
        self.e2e = Histogram(E2E, "End-to-end request latency", boundaries=LATENCY_BUCKETS_S,
                             tag_keys=model)

    def record_status(self, model: str, endpoint: str, status_code: int) -> None:
        self.requests.inc(tags={"model": model, "endpoint": endpoint, "status_code": str(status_code)})

    def record_request(self, model: str, start: float, first_token: float | None,
                       num_prompt: int, num_cached: int, num_generated: int) -> None:
        tags = {"model": model}
        end = time.monotonic()
        for counter, value in ((self.prompt_tokens, num_prompt), (self.cached_prompt_tokens, num_cached),
                               (self.generation_tokens, num_generated)):
            if value:
                counter.inc(value, tags=tags)
        self.e2e.observe(end - start, tags=tags)
        if first_token is not None:
            self.ttft.observe(first_token - start, tags=tags)
            if num_generated > 1:
                self.tpot.observe((end - first_token) / (num_generated - 1), tags=tags)


async def prometheus_text(timeout_s: float = 2.0) -> str:
    """Our metrics from every alive node's Ray metrics export, in Prometheus text format."""
    import httpx
    import ray

    nodes = await asyncio.to_thread(ray.nodes)
    urls = [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in nodes if n.get("Alive") and n.get("MetricsExportPort")]
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        replies = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
    seen_meta: set[str] = set()
    lines: list[str] = []
    for reply in replies:
        if isinstance(reply, BaseException) or reply.status_code != 200:
            continue
        for line in reply.text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[2].startswith(EXPORT_PREFIX) and line not in seen_meta:
                    seen_meta.add(line)
                    lines.append(line)
            elif line.startswith(EXPORT_PREFIX):
                lines.append(line)
    return "\n".join(lines) + "\n"
