"""One router's run of `python -m bench.fleet`, and all of them, side by side in processes of
their own: each run is a fresh fleet under the same seeded workload, so runs are independent."""
from __future__ import annotations

import cProfile
import multiprocessing
import os
import pstats
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from bench.fleet import cost_model as costs
from bench.fleet.autoscaler import AutoscalerSettings
from bench.fleet.fleet import Fleet, FleetSettings
from bench.fleet.replica import ReplicaSettings
from bench.fleet.report import summarize
from bench.fleet.workloads import Workload, WorkloadSettings
from pagedserve.serve_app.routing.policy import RoutingSettings


def build(args) -> tuple[costs.CostModel, ReplicaSettings, FleetSettings]:
    model = costs.load(args.cost_model)
    replica = ReplicaSettings(num_blocks=args.num_blocks, block_size=args.block_size,
                              max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    autoscaler = None
    if args.workload == "diurnal":
        autoscaler = AutoscalerSettings(min_replicas=args.min_replicas,
                                        max_replicas=args.max_replicas or 4 * args.replicas,
                                        startup_s=args.startup_s)
    settings = FleetSettings(num_replicas=args.replicas, replica=replica,
                             stats_period_s=args.stats_period_s, stats_delay_s=args.stats_delay_s,
                             max_queued_requests=args.max_queued_requests, autoscaler=autoscaler,
                             num_ingresses=args.ingresses,
                             routing=RoutingSettings(**args.routing_kwargs))
    return model, replica, settings


def make_workload(args) -> Workload:
    return Workload(args.workload, WorkloadSettings(
        rate=args.rate, duration_s=args.duration_s, block_size=args.block_size,
        num_stages=args.num_stages, num_tenants=args.tenants,
        output_tokens=args.output_tokens), args.seed)


def run_router(name: str, args) -> dict:
    """One router's run on a fresh fleet and workload (same seed: the same requests): its
    summary. Runs in a worker process under --jobs, so it takes only picklable arguments."""
    model, _, settings = build(args)
    start, cpu = time.perf_counter(), time.process_time()
    fleet = Fleet(name, make_workload(args), model, settings, args.seed)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(fleet.run)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    else:
        fleet.run()
    result = summarize(fleet, time.perf_counter() - start)
    result["cpu_s"] = time.process_time() - cpu
    result["cpu_us_per_request"] = result["cpu_s"] * 1e6 / max(1, result["num_requests"])
    return result


# Started first when runs go side by side, so the last to start is a short one (wall s of each at
# 100 replicas x 5,000 req/s x 10 s on a 2-core Zen 4: approx 14, oracle 14, pagedserve 11,
# random 7, p2c 6).
_SLOW_RUNS = ("approx", "oracle", "pagedserve")


def _slowest_first(name: str) -> int:
    return _SLOW_RUNS.index(name) if name in _SLOW_RUNS else len(_SLOW_RUNS)


def run_routers(names: list[str], args) -> dict[str, dict]:
    """Each router's summary, in `names` order, printed as each finishes. Runs are independent
    (a fresh fleet each, seeded), so they run in parallel processes; decision costs are CPU time
    (`time.thread_time`), each process on its own core."""
    jobs = 1 if args.profile else min(len(names), args.jobs or os.cpu_count() or 1)
    routers: dict[str, dict] = {}

    def report(name: str, r: dict) -> None:
        routers[name] = r
        print(f"{name:>10}: TTFT p50/p90/p99 {r['ttft_p50_s']:.3f}/{r['ttft_p90_s']:.3f}/"
              f"{r['ttft_p99_s']:.3f} s  hit {r['hit_rate']:.3f}  rejected {r['rejection_rate']:.3f}"
              f"  {r['output_tok_s']:.0f} tok/s  {r['replica_seconds']:.0f} replica-s  "
              f"decision p99 {r['decision_us_p99']:.0f} us  ({r['wall_s']:.1f} s wall, "
              f"{r['cpu_s']:.1f} s CPU)", flush=True)

    if jobs <= 1:
        for name in names:
            report(name, run_router(name, args))
    else:
        # spawn: a fresh interpreter per worker, nothing inherited but the arguments
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run_router, name, args): name
                       for name in sorted(names, key=_slowest_first)}
            for future in as_completed(futures):
                report(futures[future], future.result())
    return {name: routers[name] for name in names}
