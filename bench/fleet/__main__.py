"""python -m bench.fleet --replicas N --rate R --duration-s S --workload llmd|chat|nosharing|diurnal
   --routers pagedserve,p2c,approx,random,oracle --seed K --out FILE.json

Runs the same workload (same seed) through each router on a fresh simulated fleet, prints a
table and the ratios against pagedserve's router, and writes FILE.json and FILE.png. `--quick`
is a small run for a laptop-sized check; the defaults are small too. The diurnal workload turns on
the autoscaler (from --min-replicas, starting at --replicas) and reports replica-seconds against
the ideal: each second, the fewest replicas that hold its rate at the target queue depth, from
each fleet size's capacity measured in the same simulator at constant rates
(`bench/fleet/ideal.py`); and the longest stretch the queue stayed above 3x the target.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.common import RESULTS_DIR, cpu_info
from bench.fleet import cost_model as costs
from bench.fleet import ideal
from bench.fleet.autoscaler import AutoscalerSettings
from bench.fleet.fleet import ROUTERS, FleetSettings
from bench.fleet.replica import ReplicaSettings
from bench.fleet.report import plot, ratios
from bench.fleet.runs import build, make_workload, run_routers
from bench.fleet.workloads import WORKLOADS, WorkloadSettings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[1])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--rate", type=float, default=80.0, help="req/s at the top of the ramp / peak")
    p.add_argument("--duration-s", type=float, default=100.0)
    p.add_argument("--workload", choices=WORKLOADS, default="llmd")
    p.add_argument("--routers", default="pagedserve,p2c,approx,random,oracle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "fleet.json")
    p.add_argument("--cost-model", default="h200",
                   help=f"a GPU profile ({', '.join(costs.GPU_PROFILES)}) or a calibration JSON")
    p.add_argument("--num-blocks", type=int, default=ReplicaSettings.num_blocks)
    p.add_argument("--block-size", type=int, default=ReplicaSettings.block_size)
    p.add_argument("--max-num-seqs", type=int, default=ReplicaSettings.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=ReplicaSettings.max_num_batched_tokens)
    p.add_argument("--stats-period-s", type=float, default=FleetSettings.stats_period_s)
    p.add_argument("--stats-delay-s", type=float, default=FleetSettings.stats_delay_s)
    p.add_argument("--max-queued-requests", type=int, default=FleetSettings.max_queued_requests)
    p.add_argument("--num-stages", type=int, default=WorkloadSettings.num_stages)
    p.add_argument("--tenants", type=int, default=WorkloadSettings.num_tenants)
    p.add_argument("--output-tokens", type=int, default=WorkloadSettings.output_tokens)
    p.add_argument("--ingresses", type=int, default=FleetSettings.num_ingresses,
                   help="ingress replicas, each routing with a router of its own (the oracle: one)")
    p.add_argument("--routing-kwargs", type=json.loads, default={},
                   help="request_router_kwargs for pagedserve's router (and the oracle), as JSON")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=None)
    p.add_argument("--startup-s", type=float, default=AutoscalerSettings.startup_s)
    p.add_argument("--ideal-precision", type=float, default=None,
                   help="diurnal: req/s to which each fleet size's capacity is measured for the "
                        "ideal (default: 2%% of --rate)")
    p.add_argument("--ideal-run-s", type=float, default=120.0,
                   help="diurnal: simulated seconds of each ideal measurement (half warm-up)")
    p.add_argument("--jobs", type=int, default=None,
                   help="routers simulated at once, each in its own process (default: one per "
                        "CPU core, at most one per router); 1 runs them one after another here")
    p.add_argument("--profile", action="store_true",
                   help="profile each router's run (cProfile) and print where its time goes "
                        "(one at a time)")
    p.add_argument("--quick", action="store_true",
                   help="4 replicas, 40 tenants, 20 simulated seconds: a check that it all runs")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.tenants, args.duration_s = 4, 40, 20.0
        args.rate, args.num_blocks = 40.0, 8000
    return args


def measure_ideal(args, router: str = "pagedserve") -> dict:
    """A diurnal run's ideal (`bench.fleet.ideal`), under pagedserve's router: each fleet size's
    capacity, and the replica-seconds they need for the day, both bounds."""
    model, _, settings = build(args)
    workload = make_workload(args)
    trial = ideal.Trial(router, workload.name,
                        replace(workload.settings, duration_s=args.ideal_run_s), model, settings,
                        settings.autoscaler.target_queue_depth, args.seed)
    jobs = args.jobs or os.cpu_count() or 1
    with ideal.measured_by(trial, jobs) as measure:
        found = ideal.capacities(measure, args.rate, args.ideal_precision or 0.02 * args.rate,
                                 settings.autoscaler.max_replicas, width=jobs)
    each_second = ideal.ideal_replicas(workload, found, args.min_replicas)
    # JSON has no infinity: a capacity not bounded above (it held the peak) fails at None
    return {"capacities": [asdict(c) | {"fails": None if math.isinf(c.fails) else c.fails}
                           for c in found],
            "replica_seconds": float(sum(each_second)),
            "replicas_each_second": each_second,
            "replica_seconds_upper": ideal.ideal_replica_seconds(workload, found, args.min_replicas,
                                                                 optimistic=False),
            "foresight_replica_seconds": ideal.foresight_replica_seconds(
                workload, found, args.min_replicas,
                settings.autoscaler.upscale_delay_s + settings.autoscaler.startup_s,
                settings.autoscaler.downscale_delay_s)}


def main(argv=None, exiting: bool = False) -> dict:
    """exiting: the process ends after (the command line), so its garbage need not be freed."""
    args = parse_args(argv)
    model, replica, settings = build(args)
    names = [r.strip() for r in args.routers.split(",") if r.strip()]
    for name in names:
        if name not in ROUTERS:
            raise SystemExit(f"unknown router {name!r}: use some of {', '.join(ROUTERS)}")
    cpu = cpu_info()  # it imports torch: before a fleet fills the heap (see the freeze below)
    began = time.perf_counter()
    routers = run_routers(names, args)
    if "oracle" in routers:
        for r in routers.values():
            oracle = routers["oracle"]["hit_rate"]
            r["hit_rate_of_oracle"] = r["hit_rate"] / oracle if oracle else float("nan")
    result = {"routers": routers, "ratios": ratios(routers), "wall_s": time.perf_counter() - began,
              "command": vars(args) | {"out": str(args.out)}, "cost_model": model.__repr__(),
              "cpu": cpu}
    if settings.autoscaler is not None:
        began_ideal = time.perf_counter()
        result["ideal"] = measure_ideal(args)
        result["ideal_replica_seconds"] = result["ideal"]["replica_seconds"]
        for r in routers.values():
            r["replica_seconds_over_ideal"] = r["replica_seconds"] / result["ideal_replica_seconds"]
            r["replica_seconds_over_ideal_upper"] = (r["replica_seconds"]
                                                     / result["ideal"]["replica_seconds_upper"])
        cells = ", ".join(f"{c['replicas']}: {c['holds']:.1f}-{c['fails'] or math.inf:.1f}"
                          for c in result["ideal"]["capacities"])
        print(f"  capacity in req/s (held-failed) by replicas: {cells} "
              f"({time.perf_counter() - began_ideal:.0f} s)")
    for name, per_stage in result["ratios"].items():
        cells = "  ".join(f"{s['rate']:.0f}/s: TTFT x{s['ttft_p90_theirs_over_ours']:.2f}"
                          for s in per_stage)
        print(f"  pagedserve vs {name:>10} (their p90 / ours)  {cells}")
    if "ideal_replica_seconds" in result:
        foresight = result["ideal"]["foresight_replica_seconds"]
        print(f"  ideal replica-seconds {result['ideal_replica_seconds']:.0f} (at most "
              f"{result['ideal']['replica_seconds_upper']:.0f}); knowing the future under the "
              f"scaling delays and start-up: {foresight:.0f} "
              f"({foresight / result['ideal_replica_seconds']:.2f}x)")
        for name, r in routers.items():
            print(f"  {name:>10}: {r['replica_seconds_over_ideal']:.2f}x the ideal "
                  f"({r['replica_seconds_over_ideal_upper']:.2f}x its upper bound), queue above 3x "
                  f"target for at most {r['longest_overload_s']:.0f} s (upscale delay "
                  f"{r['upscale_delay_s']:.0f} s), at most {r['max_replicas_used']} replicas")
    if exiting:
        # The last fleet run here is garbage now, gigabytes of it at a thousand replicas: kept
        # out of the collector's sight, the next full collection (plotting sets one off) does
        # not walk it, ~25 s after a 20-s run at 1,000 replicas.
        gc.freeze()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    png = plot(routers, args.out.with_suffix(".png"),
               f"{args.workload}: {args.replicas} replicas, up to {args.rate:g} req/s",
               ideal=result.get("ideal", {}).get("replicas_each_second"))
    print(f"wrote {args.out} and {png} in {result['wall_s']:.1f} s")
    return result


if __name__ == "__main__":
    main(exiting=True)
