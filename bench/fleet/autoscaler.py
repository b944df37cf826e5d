"""Ray Serve's autoscaling loop around the real policy (`pagedserve.serve_app.autoscaling.QueueDepthPolicy`):
replicas push `record_autoscaling_stats()` every `metrics_interval_s`; each control tick averages
each replica's pushes of each metric over `look_back_period_s` into `ctx.aggregated_metrics`
(`{metric: {replica: mean}}`), calls the policy,
and applies Ray's delay rule (a change must be wanted without a break for `upscale_delay_s` /
`downscale_delay_s`, measured in time, as `ray.serve.autoscaling_policy._apply_delay_logic` does).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from pagedserve.serve_app.autoscaling import DEFAULTS, QueueDepthPolicy, QueueDepthPolicySettings


@dataclass
class AutoscalerSettings:
    min_replicas: int = 1
    max_replicas: int = 1000
    target_queue_depth: float = DEFAULTS["target_queue_depth"]
    downscale_ratio: float = DEFAULTS["downscale_ratio"]
    target_load: float = DEFAULTS["target_load"]
    lead_s: float = DEFAULTS["lead_s"]
    trend_window_s: float = DEFAULTS["trend_window_s"]
    cache_coverage: float = DEFAULTS["cache_coverage"]
    cache_fill: float = DEFAULTS["cache_fill"]
    rewarm_s: float = DEFAULTS["rewarm_s"]
    warmup_s: float = DEFAULTS["warmup_s"]
    upscale_delay_s: float = DEFAULTS["upscale_delay_s"]
    downscale_delay_s: float = DEFAULTS["downscale_delay_s"]
    metrics_interval_s: float = DEFAULTS["metrics_interval_s"]
    look_back_period_s: float = DEFAULTS["look_back_period_s"]
    control_interval_s: float = 0.5  # Ray's controller loop runs every 0.1 s; coarser is cheaper
    startup_s: float = 30.0  # a new replica's start-up: schedule, load weights, warm up


@dataclass
class Autoscaler:
    settings: AutoscalerSettings
    policy: QueueDepthPolicy = field(init=False)
    samples: dict[str, deque] = field(default_factory=dict)  # replica -> (time, stats)
    policy_state: dict = field(default_factory=dict)
    wanted_since: float | None = None
    wanted_direction: int = 0

    def __post_init__(self):
        # The policy's own settings, by the names it declares
        self.policy = QueueDepthPolicy(**{name: getattr(self.settings, name)
                                          for name in QueueDepthPolicySettings.model_fields})

    def push(self, replica_id: str, stats: dict[str, float], now: float) -> None:
        """A replica's `record_autoscaling_stats()`, as it reaches the controller."""
        self.samples.setdefault(replica_id, deque()).append((now, dict(stats)))

    def decide(self, now: float, running: list[str], target: int, queued: int) -> int:
        """The new target number of replicas (== target when nothing changes)."""
        horizon = now - self.settings.look_back_period_s
        averaged: dict[str, dict[str, float]] = {}
        live = set(running)
        for replica_id in list(self.samples):
            window = self.samples[replica_id]
            while window and window[0][0] < horizon:
                window.popleft()
            if replica_id not in live:
                if not window:
                    del self.samples[replica_id]
                continue
            for metric in (window[-1][1] if window else ()):
                values = [stats.get(metric, 0.0) for _, stats in window]
                averaged.setdefault(metric, {})[replica_id] = sum(values) / len(values)
        ctx = SimpleNamespace(
            current_num_replicas=len(running), target_num_replicas=target,
            running_replicas=running, total_queued_requests=float(queued),
            aggregated_metrics=averaged,
            capacity_adjusted_min_replicas=self.settings.min_replicas,
            capacity_adjusted_max_replicas=self.settings.max_replicas,
            policy_state=self.policy_state, current_time=now)
        desired, self.policy_state = self.policy(ctx)
        return self._apply_delay(desired, target, now)

    def _apply_delay(self, desired: int, target: int, now: float) -> int:
        direction = (desired > target) - (desired < target)
        if direction == 0:
            self.wanted_direction, self.wanted_since = 0, None
            return target
        if direction != self.wanted_direction:
            self.wanted_direction, self.wanted_since = direction, now
        delay = self.settings.upscale_delay_s if direction > 0 else self.settings.downscale_delay_s
        if now - self.wanted_since + 1e-9 >= delay:
            self.wanted_direction, self.wanted_since = 0, None
            return max(1, desired)
        return target
