"""What a run measured, per router and per load step, and the PNG that shows it."""
from __future__ import annotations

import math
from pathlib import Path

from bench.fleet.fleet import Fleet


def percentile(values, q: float) -> float:
    if not len(values):
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _summary(fleet: Fleet, stage: int | None) -> dict:
    o = fleet.outcome
    picked = [i for i in range(len(o.stage)) if stage is None or o.stage[i] == stage]
    ttft = [o.ttft_s[i] for i in picked]
    served = [i for i in picked if not o.censored[i]]
    prompt = sum(o.prompt_tokens[i] for i in served)
    cached = sum(o.cached_tokens[i] for i in served)
    arrivals = sum(fleet.num_arrivals) if stage is None else fleet.num_arrivals[stage]
    rejected = sum(fleet.num_rejected) if stage is None else fleet.num_rejected[stage]
    return {"ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "ttft_p99_s": percentile(ttft, 0.99), "hit_rate": cached / prompt if prompt else 0.0,
            "rejection_rate": rejected / arrivals if arrivals else 0.0,
            "num_requests": arrivals, "num_first_tokens": len(served),
            "num_waiting_at_end": len(picked) - len(served)}


def queue_per_replica(fleet: Fleet) -> list[float]:
    """Each sample's waiting requests (in the handle and in the replicas) per replica."""
    s = fleet.series
    return [hq / max(1, n) + rq for hq, rq, n in zip(s["handle_queue"], s["replica_queue"],
                                                       s["replicas"])]


def longest_above(values: list[float], limit: float, period_s: float) -> float:
    """The longest run of consecutive samples above limit, in seconds."""
    longest = run = 0
    for value in values:
        run = run + 1 if value > limit else 0
        longest = max(longest, run)
    return longest * period_s


def summarize(fleet: Fleet, wall_s: float) -> dict:
    """The figures the command reports for one router's run. TTFT of requests still waiting at
    the end counts as the time they had waited (a lower bound), so a saturated router's tail is
    not hidden by the requests it never served."""
    duration = fleet.workload.settings.duration_s
    decisions = fleet.decision_s
    total = _summary(fleet, None)
    output_tokens = sum(r.num_output_tokens for r in fleet.replicas.values()) + fleet.removed_output_tokens
    series = fleet.series
    autoscaling = {}
    if fleet.autoscaler is not None:
        # The goal: no stretch of queue above 3x target longer than one upscale delay.
        a = fleet.autoscaler.settings
        autoscaling = {"longest_overload_s": longest_above(
            queue_per_replica(fleet), 3 * a.target_queue_depth, fleet.settings.sample_period_s),
            "upscale_delay_s": a.upscale_delay_s, "max_replicas_used": max(series["replicas"])}
    return {
        **total,
        **autoscaling,
        "output_tok_s": output_tokens / duration,
        "replica_seconds": fleet.replica_seconds,
        "mean_replica_queue": sum(series["replica_queue"]) / max(1, len(series["replica_queue"])),
        "mean_handle_queue": sum(series["handle_queue"]) / max(1, len(series["handle_queue"])),
        "decision_us_p50": percentile(decisions, 0.5) * 1e6,
        "decision_us_p99": percentile(decisions, 0.99) * 1e6,
        "num_decisions": len(decisions),
        "wall_s": wall_s,
        "stages": [{"rate": rate, **_summary(fleet, i)}
                   for i, rate in enumerate(fleet.workload.stage_rates())],
        "series": series,
    }


def ratios(routers: dict[str, dict], ours: str = "pagedserve") -> dict:
    """Ours against each other router at every load step: TTFT p90 (theirs / ours: > 1 means
    ours is faster) and hit rate (ours / theirs)."""
    if ours not in routers:
        return {}
    out = {}
    for name, result in routers.items():
        if name == ours:
            continue
        per_stage = []
        for mine, theirs in zip(routers[ours]["stages"], result["stages"]):
            per_stage.append({
                "rate": mine["rate"],
                "ttft_p90_theirs_over_ours": _div(theirs["ttft_p90_s"], mine["ttft_p90_s"]),
                "hit_rate_ours_over_theirs": _div(mine["hit_rate"], theirs["hit_rate"])})
        out[name] = per_stage
    return out


def _div(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def plot(routers: dict[str, dict], path: Path, title: str,
         ideal: list[int] | None = None) -> Path:
    """ideal: the replicas each second needs (an autoscaled run's yardstick), drawn beside the
    replicas each router's run used."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for name, r in routers.items():
        rates = [s["rate"] for s in r["stages"]]
        axes[0][0].plot(rates, [s["ttft_p90_s"] for s in r["stages"]], marker="o", label=name)
        axes[0][1].plot(rates, [s["hit_rate"] for s in r["stages"]], marker="o", label=name)
        axes[1][0].plot(r["series"]["t"], r["series"]["replicas"], label=name)
        axes[1][1].plot(r["series"]["t"], r["series"]["handle_queue"], label=name)
    if ideal:
        axes[1][0].step(range(len(ideal)), ideal, where="post", color="black", linestyle="--",
                        linewidth=1, label="ideal")
    axes[0][0].set(xlabel="offered load (req/s)", ylabel="TTFT p90 (s)", yscale="log")
    axes[0][1].set(xlabel="offered load (req/s)", ylabel="prefix-cache hit rate", ylim=(0, 1))
    axes[1][0].set(xlabel="simulated time (s)", ylabel="replicas")
    axes[1][1].set(xlabel="simulated time (s)", ylabel="requests queued at the handle")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
