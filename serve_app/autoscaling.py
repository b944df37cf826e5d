"""Autoscaling for the engine replicas: a custom Ray Serve autoscaling policy.

Each replica reports three things (`record_autoscaling_stats`, see `pagedserve.replicas.core.cache_digest`),
which Ray Serve averages per replica over `look_back_period_s`:
- `queue_depth`: waiting sequences plus KV-cache pressure. Requests still queued in the ingress
  handles (every replica at its `max_ongoing_requests`) are queued too.
- `load`: the fraction of its capacity in use, in sequence slots, KV blocks or compute. A
  queue forms only once a replica is full, and under continuous batching the climb to full is
  steep at the end, so waiting for the queue means scaling up after the latency has gone.
- `kv_working_set`: the KV cache its prompts' prefix reuse needs, in replicas' worth. Scaled
  below it, requests re-prefill their shared contexts, each replica does several times the
  work, the queues explode, and the fleet scales back up, in a cycle.

The policy asks for the most that any of them asks for: replicas to hold the queue at
`target_queue_depth` each, the load at `target_load` each, and caches that hold
`cache_coverage` of the working set. It scales up as soon as one is exceeded and down only
when all have room to spare (the queue and the load with `downscale_ratio` headroom, the working
set within `cache_fill` of the caches left), in bounded steps (`desired_num_replicas` says why);
for `rewarm_s` after a scale-down it grows back at most to the replicas before it. A replica's
queue in its first `warmup_s` of serving is left out of the queue rule.

Ray Serve wraps the policy with `upscale_delay_s` / `downscale_delay_s` (a change must be wanted
that long before it happens), `min_replicas` / `max_replicas`, and the scaling factors. A replica
being removed leaves the routers first, then drains its in-flight requests for up to
`graceful_shutdown_timeout_s`, so scaling down fails no request that finishes within it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.replicas.core.cache_digest import (
    KV_WORKING_SET_METRIC, LOAD_METRIC, QUEUE_DEPTH_METRIC,
)

# Bounds on one decision's step (`desired_num_replicas` says why): up to STEP_UP times the
# replicas (or 4 more), down by at most 1 / STEP_DOWN of them.
STEP_UP = 1.5
STEP_DOWN = 2
TURNED = 0.9  # a load this far below its last half-minute's peak has stopped rising
POLICY_PATH = "pagedserve.serve_app.autoscaling:QueueDepthPolicy"

DEFAULTS = dict(
    target_queue_depth=4.0,
    # Scale down only to replicas this far under the targets: a band, so a removal does not
    # bring the next addition back. A wider band cost more replica-seconds in the fleet
    # simulator's days for no better latency (`python -m bench.fleet --workload diurnal`).
    downscale_ratio=0.9,
    # Each replica's load to aim for: the rest is headroom for the load's growth while new
    # replicas start.
    target_load=0.8,
    # How far ahead the load's trend is followed: the time a replica asked for now takes to
    # serve (the upscale delay, a replica's start-up and the stats windows' lag), with a margin;
    # 0 follows the load as it is.
    lead_s=60.0,
    trend_window_s=60.0,  # the load history the trend is fitted over
    # The share of the fleet's reused prefix working set its KV caches must be able to hold, or
    # it scales up. Not all of it: a cache a little short of it loses a few hits, which the load
    # then shows; far short of it, every request re-prefills its shared context: the cliff.
    # 0 turns the working-set floors off.
    cache_coverage=0.8,
    # The share of the remaining replicas' KV cache the working set may fill for a scale-down:
    # the rest is for the running sequences' own blocks, which grow with the load the removed
    # replica hands over.
    cache_fill=2 / 3,
    # For this long after a scale-down, scale up at most back to the replicas before it: the
    # surge that follows a scale-down is mostly the remaining replicas re-prefilling the removed
    # ones' prefixes, which reads as growth to the queue and to the load's trend. 0: no cap.
    rewarm_s=60.0,
    # A replica's queue in its first seconds of serving is its cache warming, not demand: the
    # router moves tenants' homes onto it (the cold homes of the grown set, load-override past
    # busy holders) and each re-prefills its shared context there. Read as growth, that queue
    # asked for a bounded step more on every scale-up while the load rose, overshooting what held
    # the load (bench.fleet --workload diurnal). Its load and working set count from the start;
    # 0 counts its queue too.
    warmup_s=30.0,
    upscale_delay_s=10.0,  # Ray Serve LLM's default target is effectively "never": ours scales
    downscale_delay_s=60.0,
    metrics_interval_s=1.0,  # how often replicas push their stats
    look_back_period_s=5.0,  # the window each replica's stats are averaged over
    graceful_shutdown_timeout_s=120.0,  # long enough for a long generation on a CPU replica
)


class QueueDepthPolicySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_queue_depth: float = Field(DEFAULTS["target_queue_depth"], gt=0)
    downscale_ratio: float = Field(DEFAULTS["downscale_ratio"], gt=0, le=1)
    target_load: float = Field(DEFAULTS["target_load"], gt=0, le=1)
    lead_s: float = Field(DEFAULTS["lead_s"], ge=0)
    trend_window_s: float = Field(DEFAULTS["trend_window_s"], gt=0)
    cache_coverage: float = Field(DEFAULTS["cache_coverage"], ge=0, le=1)
    cache_fill: float = Field(DEFAULTS["cache_fill"], gt=0, le=1)
    rewarm_s: float = Field(DEFAULTS["rewarm_s"], ge=0)
    warmup_s: float = Field(DEFAULTS["warmup_s"], ge=0)


def desired_num_replicas(total_queue_depth: float, num_replicas: int, target_queue_depth: float,
                         downscale_ratio: float = DEFAULTS["downscale_ratio"],
                         total_load: float = 0.0, total_working_set: float = 0.0,
                         target_load: float = DEFAULTS["target_load"],
                         cache_coverage: float = DEFAULTS["cache_coverage"],
                         cache_fill: float = DEFAULTS["cache_fill"]) -> int:
    """total_load and total_working_set are in replicas' worth (sums of per-replica fractions).

    Both directions move in bounded steps. Up: a queue is a backlog, not a rate, so queue /
    target (a burst of 1,000 asks for 250) overshoots, and the replicas it asks for arrive after
    the backlog has gone; at most STEP_UP times the replicas, or 4 more, per decision, as
    Kubernetes' HPA bounds its own; a queue that persists takes more. Down: each replica
    removed hands its cached prefixes' traffic to the others, which must prefill it again; half
    at a time keeps that re-prefill a fraction of the fleet's work."""
    n = num_replicas
    # 1e-9: float noise (4 x 0.8 / 0.8 must not ask for 5)
    by_load = math.ceil(total_load / target_load - 1e-9)
    if cache_coverage <= 0:  # the working-set floors off
        total_working_set = 0.0
    by_cache = math.ceil(total_working_set * cache_coverage - 1e-9)
    wanted = max(by_load, by_cache)
    if total_queue_depth > target_queue_depth * n:
        wanted = max(wanted, math.ceil(total_queue_depth / target_queue_depth))
    if wanted > n:
        return min(wanted, max(math.ceil(STEP_UP * n - 1e-9), n + 4))
    # Down with headroom in the load and the cache too: a replica fewer also means less KV cache,
    # so fewer prefix hits and more prefill for the rest, a load the remaining replicas' figures
    # cannot show before it happens.
    by_queue = math.ceil(total_queue_depth / (target_queue_depth * downscale_ratio))
    by_load = math.ceil(total_load / (target_load * downscale_ratio) - 1e-9)
    by_cache = math.ceil(total_working_set / cache_fill - 1e-9)
    floor = max(by_queue, by_load, by_cache)
    if floor >= n:
        return n
    return max(floor, n - max(1, n // STEP_DOWN))


def _summed(ctx, metric: str, replica_ids: Iterable[Any] | None = None) -> float:
    """metric's window averages summed over replica_ids (None: the running replicas)."""
    per_replica = (ctx.aggregated_metrics or {}).get(metric, {})
    if replica_ids is None:
        replica_ids = ctx.running_replicas
    return sum(float(per_replica.get(replica_id, 0.0)) for replica_id in replica_ids)


def total_queue_depth(ctx) -> float:
    """Window-averaged queue depth summed over running replicas, plus requests queued in handles."""
    return _summed(ctx, QUEUE_DEPTH_METRIC) + float(ctx.total_queued_requests or 0.0)


def warming_queue_depth(ctx, state: dict[str, Any], now: float | None, warmup_s: float) -> float:
    """The window-averaged queue depth of the replicas in their first warmup_s of serving, and
    when each running replica was first seen (`state["serving_since"]`). Only a replica that
    joins running ones warms up: those running at the policy's first call (a restarted
    controller finds replicas long in service) or when none ran (a deployment's first, or the
    first after zero) take no tenants from anyone, so their queue is demand."""
    if now is None or warmup_s <= 0:
        return 0.0
    seen = state.get("serving_since")
    first_seen = now if seen else float("-inf")
    since = {r: (seen or {}).get(r, first_seen) for r in ctx.running_replicas}
    state["serving_since"] = since
    return _summed(ctx, QUEUE_DEPTH_METRIC, [r for r, t in since.items() if now - t < warmup_s])


def rewarm_cap(state: dict[str, Any], now: float, current: int, rewarm_s: float) -> int | None:
    """The most replicas to grow to: for rewarm_s after a scale-down, those before it (None: no
    cap). Keeps the replicas seen now (`state["num_replicas"]`) and the last scale-down, as
    (time, replicas before it), in `state["scaled_down"]`; replicas stopping over several ticks
    are one scale-down."""
    before = state.get("num_replicas")
    scaled_down = state.get("scaled_down")
    recent = scaled_down is not None and now - scaled_down[0] < rewarm_s
    if before is not None and current < before:
        before = max(before, scaled_down[1]) if recent else before
        scaled_down = state["scaled_down"] = (now, before)
        recent = rewarm_s > 0  # it happened now
    state["num_replicas"] = current
    return max(scaled_down[1], current) if recent else None


def load_trend(history: list[tuple[float, float]]) -> float:
    """The least-squares slope of (time, load) points, per second; 0 with fewer than 3 or
    no spread in time."""
    if len(history) < 3:
        return 0.0
    mean_t = sum(t for t, _ in history) / len(history)
    mean_y = sum(y for _, y in history) / len(history)
    var = sum((t - mean_t) ** 2 for t, _ in history)
    if var <= 0:
        return 0.0
    return sum((t - mean_t) * (y - mean_y) for t, y in history) / var


def policy(ctx, *, target_queue_depth: float = DEFAULTS["target_queue_depth"],
           downscale_ratio: float = DEFAULTS["downscale_ratio"],
           target_load: float = DEFAULTS["target_load"], lead_s: float = DEFAULTS["lead_s"],
           trend_window_s: float = DEFAULTS["trend_window_s"],
           cache_coverage: float = DEFAULTS["cache_coverage"],
           cache_fill: float = DEFAULTS["cache_fill"],
           rewarm_s: float = DEFAULTS["rewarm_s"],
           warmup_s: float = DEFAULTS["warmup_s"]) -> tuple[int, dict[str, Any]]:
    """`fn(ctx) -> (num_replicas, state)`: Ray Serve's custom autoscaling policy signature.

    A rising load would outrun replicas asked for only once it is there: a replica serves
    `lead_s` after the policy asks. So the load the policy plans for is the larger of now's and
    where its trend over `trend_window_s` (kept in the policy state) leads in `lead_s`; a
    falling trend never plans for less than now's, nor does one that has turned."""
    state = dict(ctx.policy_state or {})
    now = getattr(ctx, "current_time", None)
    depth = total_queue_depth(ctx) - warming_queue_depth(ctx, state, now, warmup_s)
    load = _summed(ctx, LOAD_METRIC)
    working_set = _summed(ctx, KV_WORKING_SET_METRIC)
    planned = load
    if now is not None and lead_s > 0:
        history = [(t, y) for t, y in state.get("load_history", ()) if t > now - trend_window_s]
        history.append((now, load))
        state["load_history"] = history
        if now - history[0][0] >= trend_window_s / 2:  # a start-up's first points are no trend
            # Rising over the window and over its latter half, and not fallen from the latter
            # half's peak: a load that rose and has dropped back still fits a rising line.
            recent = [(t, y) for t, y in history if t >= now - trend_window_s / 2]
            if load >= TURNED * max(y for _, y in recent):
                slope = min(load_trend(history), load_trend(recent))
                planned = max(load, load + slope * lead_s)
    current = ctx.current_num_replicas
    num_replicas = desired_num_replicas(depth, current, target_queue_depth,
                                        downscale_ratio, planned, working_set, target_load,
                                        cache_coverage, cache_fill)
    cap = rewarm_cap(state, now, current, rewarm_s) if now is not None else None
    if cap is not None:
        num_replicas = min(num_replicas, cap)
    num_replicas = max(ctx.capacity_adjusted_min_replicas,
                       min(ctx.capacity_adjusted_max_replicas, num_replicas))
    state.update(queue_depth=depth, load=load, planned_load=planned, kv_working_set=working_set,
                 desired_num_replicas=num_replicas)
    return num_replicas, state


class QueueDepthPolicy:
    """The policy with its settings bound: Ray Serve instantiates a class policy once with
    `policy_kwargs` and calls it every autoscaling tick."""

    def __init__(self, **kwargs):
        self.settings = QueueDepthPolicySettings(**kwargs)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        return policy(ctx, **self.settings.model_dump())


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
