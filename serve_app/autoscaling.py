"""Queue-depth autoscaling for the engine replicas: a custom Ray Serve autoscaling policy.

Each replica reports `queue_depth` (`record_autoscaling_stats`: waiting sequences plus KV-cache
pressure, see `replicas.cache_digest`); Ray Serve averages it per replica over
`look_back_period_s`. Requests still queued in the ingress handles (every replica at its
`max_ongoing_requests`) are queued too. The policy asks for enough replicas that each holds at
most `target_queue_depth` of that total; it gives one back only when the rest would hold the total
with headroom (`downscale_ratio`), so the count does not flap at the boundary.

Queue depth alone is 0 while nothing waits, however full the batches: a fleet that just keeps up
would be scaled down, queue, scale up, and so on. So each replica also reports its
`batch_occupancy` (running sequences / max_num_seqs), and the policy never gives back a replica
unless the rest could run what runs now with their batches at most `downscale_ratio` full.

Ray Serve wraps the policy with `upscale_delay_s` / `downscale_delay_s` (a change must be wanted
that long before it happens), `min_replicas` / `max_replicas`, and the scaling factors. A replica
being removed leaves the routers first, then drains its in-flight requests for up to
`graceful_shutdown_timeout_s`, so scaling down fails no request that finishes within it.
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from replicas.cache_digest import BATCH_OCCUPANCY_METRIC, QUEUE_DEPTH_METRIC

POLICY_PATH = "serve_app.autoscaling:QueueDepthPolicy"

DEFAULTS = dict(
    target_queue_depth=4.0,
    downscale_ratio=0.8,
    upscale_delay_s=10.0,  # Ray Serve LLM's default target is effectively "never": ours scales
    downscale_delay_s=60.0,
    metrics_interval_s=1.0,  # how often replicas push queue_depth
    look_back_period_s=5.0,  # the window each replica's queue_depth is averaged over
    graceful_shutdown_timeout_s=120.0,  # long enough for a long generation on a CPU replica
)


class QueueDepthPolicySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_queue_depth: float = Field(DEFAULTS["target_queue_depth"], gt=0)
    downscale_ratio: float = Field(DEFAULTS["downscale_ratio"], gt=0, le=1)


def desired_num_replicas(total_queue_depth: float, num_replicas: int, target_queue_depth: float,
                         downscale_ratio: float = DEFAULTS["downscale_ratio"],
                         total_occupancy: float = 0.0) -> int:
    """Up as soon as the average queue exceeds the target; down only with headroom to spare, in
    the queues and in the batches (total_occupancy: replicas' worth of full batches running)."""
    if total_queue_depth > target_queue_depth * num_replicas:
        return math.ceil(total_queue_depth / target_queue_depth)
    by_queue = math.ceil(total_queue_depth / (target_queue_depth * downscale_ratio))
    by_batches = math.ceil(total_occupancy / downscale_ratio - 1e-9)  # 1e-9: float noise of 0.8/0.8
    return min(num_replicas, max(by_queue, by_batches))


def _summed(ctx, metric: str) -> float:
    per_replica = (ctx.aggregated_metrics or {}).get(metric, {})
    return sum(float(per_replica.get(replica_id, 0.0)) for replica_id in ctx.running_replicas)


def total_queue_depth(ctx) -> float:
    """Window-averaged queue depth summed over running replicas, plus requests queued in handles."""
    return _summed(ctx, QUEUE_DEPTH_METRIC) + float(ctx.total_queued_requests or 0.0)


def total_occupancy(ctx) -> float:
    """Window-averaged batch occupancy summed over running replicas: replicas' worth of running
    sequences."""
    return _summed(ctx, BATCH_OCCUPANCY_METRIC)


def policy(ctx, *, target_queue_depth: float = DEFAULTS["target_queue_depth"],
           downscale_ratio: float = DEFAULTS["downscale_ratio"]) -> tuple[int, dict[str, Any]]:
    """`fn(ctx) -> (num_replicas, state)`: Ray Serve's custom autoscaling policy signature."""
    depth = total_queue_depth(ctx)
    occupancy = total_occupancy(ctx)
    num_replicas = desired_num_replicas(depth, ctx.current_num_replicas, target_queue_depth,
                                        downscale_ratio, occupancy)
    num_replicas = max(ctx.capacity_adjusted_min_replicas,
                       min(ctx.capacity_adjusted_max_replicas, num_replicas))
    state = dict(ctx.policy_state or {})
    state.update(queue_depth=depth, batch_occupancy=occupancy, desired_num_replicas=num_replicas)
    return num_replicas, state


class QueueDepthPolicy:
    """The policy with its settings bound: Ray Serve instantiates a class policy once with
    `policy_kwargs` and calls it every autoscaling tick."""

    def __init__(self, **kwargs):
        self.settings = QueueDepthPolicySettings(**kwargs)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        return policy(ctx, target_queue_depth=self.settings.target_queue_depth,
                      downscale_ratio=self.settings.downscale_ratio)


def autoscaling_config(*, min_replicas: int, max_replicas: int,
                       target_queue_depth: float = DEFAULTS["target_queue_depth"],
                       initial_replicas: int | None = None,
                       upscale_delay_s: float = DEFAULTS["upscale_delay_s"],
                       downscale_delay_s: float = DEFAULTS["downscale_delay_s"],
                       metrics_interval_s: float = DEFAULTS["metrics_interval_s"],
                       look_back_period_s: float = DEFAULTS["look_back_period_s"],
                       downscale_ratio: float = DEFAULTS["downscale_ratio"]) -> dict[str, Any]:
    """The replica deployment's `autoscaling_config` dict for this policy."""
    config = {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "upscale_delay_s": upscale_delay_s,
        "downscale_delay_s": downscale_delay_s,
        "metrics_interval_s": metrics_interval_s,
        "look_back_period_s": max(look_back_period_s, metrics_interval_s * 2),
        "policy": {"policy_function": POLICY_PATH,
                   "policy_kwargs": QueueDepthPolicySettings(
                       target_queue_depth=target_queue_depth,
                       downscale_ratio=downscale_ratio).model_dump()},
    }
    if initial_replicas is not None:
        config["initial_replicas"] = initial_replicas
    return config
