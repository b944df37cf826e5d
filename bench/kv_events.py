"""KV-cache events vs full snapshots on the routing path: bytes and CPU time a second, per replica.

A real `BlockManager` holds N cached blocks (10k and 100k by default) under steady churn: requests
of shared system prompts plus unique turns, about `--churn` blocks stored (and as many evicted) a
simulated second. Once a second the replica reports, both ways from the same state in the same run:

  snapshot  every report lists every cached hash (the old digest, uncapped: it was capped at
            65,536 and so inexact past that); the router replaces its set with it.
  events    `RoutingReporter` (a window of the last 3 s of events, a snapshot on the first report
            and every 60 s); the router's `CacheMirror` applies it.
  events-1s the same with a 1 s window: about the events since the last report alone (cheaper,
            but a router that misses one report must wait for the next snapshot).

Costs per report, each a stage of the real path: the replica builds it; Ray pickles it (replica ->
controller -> every router); the controller hashes `str()` of it (RunningReplicaInfo's hash); a
router unpickles it and applies it. Ray re-broadcasts every replica's stats whenever one replica's
change, so with R replicas each router unpickles about R times these figures; the ratio holds.
Prints per-second figures and the ratios; writes bench/results/kv_events.json.

    python -m bench.kv_events [--blocks 10000 100000] [--seconds 120] [--churn 300]
"""
from __future__ import annotations

import argparse
import pickle
import random
import time

from bench.common import write_result
from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.core.cache_digest import RoutingReporter
from pagedserve.replicas.core.kv_events import EVENT_WINDOW_S, BlockRemoved, BlockStored
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.sequence import Sequence
from pagedserve.serve_app.routing.cache_mirror import CacheMirror

BLOCK_SIZE = 16
NUM_SYSTEM_PROMPTS = 16
SYSTEM_PROMPT_BLOCKS = 32
REQUESTS_PER_S = 10
STAGES = ("build", "pickle", "ray_str", "unpickle", "apply")
STATS = {"num_waiting": 3, "num_running": 8, "kv_cache_usage": 0.97, "prefix_cache_hit_rate": 0.6}


class Replica:
    """A block manager under load, and the stats engine the reporter expects."""

    def __init__(self, num_blocks: int, rng: random.Random):
        self.engine = self  # RoutingReporter reads `.engine.block_manager`
        self.block_manager = BlockManager(num_blocks, BLOCK_SIZE)
        self.rng = rng
        self.system_prompts = [self.tokens(SYSTEM_PROMPT_BLOCKS * BLOCK_SIZE)
                               for _ in range(NUM_SYSTEM_PROMPTS)]

    def stats(self) -> dict:
        return dict(STATS)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(32_000) for _ in range(n)]

    def serve(self, prompt: list[int]) -> None:
        seq = Sequence("r", prompt, SamplingParams(max_tokens=1), BLOCK_SIZE)
        blocks, num_cached = self.block_manager.get_computed_blocks(seq)
        assert self.block_manager.allocate_slots(seq, seq.num_tokens - num_cached, blocks)
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.free(seq)

    def fill(self) -> None:
        """Cache a block in every slot (unique prompts of 64 blocks)."""
        for _ in range(self.block_manager.num_blocks // 64 + 1):
            self.serve(self.tokens(64 * BLOCK_SIZE + 1))

    def churn_one_second(self, blocks_per_s: int) -> None:
        unique = max(1, blocks_per_s // REQUESTS_PER_S)
        for _ in range(REQUESTS_PER_S):
            self.serve(self.rng.choice(self.system_prompts) + self.tokens(unique * BLOCK_SIZE + 1))


def snapshot_digest(replica: Replica, now: float) -> dict:
    """The old, version-1 digest: every cached hash in every report."""
    return {"version": 1, "time": now, "block_size": BLOCK_SIZE,
            "block_hashes": list(replica.block_manager.cached), **STATS}


def run_one(num_blocks: int, seconds: int, churn: int, seed: int) -> dict:
    replica = Replica(num_blocks, random.Random(seed))
    replica.fill()
    sim_now = [0.0]
    paths = {"snapshot": (lambda: snapshot_digest(replica, sim_now[0]),
                          lambda digest: set(digest["block_hashes"]))}
    mirrors = {}
    for path, window_s in (("events", EVENT_WINDOW_S), ("events-1s", 1.0)):
        reporter = RoutingReporter(replica, wall_clock=lambda: sim_now[0], clock=lambda: sim_now[0],
                                   window_s=window_s)
        mirror = mirrors[path] = CacheMirror()
        paths[path] = (reporter.report, lambda digest, m=mirror: m.apply(digest["kv_events"]))
    cpu = {path: dict.fromkeys(STAGES, 0.0) for path in paths}
    num_bytes = dict.fromkeys(paths, 0)
    replica.block_manager.kv_events.retain_s = float("inf")  # the count below reads every event
    first_seq = replica.block_manager.kv_events.next_seq

    def timed(path: str, stage: str, fn):
        start = time.process_time()
        out = fn()
        cpu[path][stage] += time.process_time() - start
        return out

    for second in range(seconds):
        sim_now[0] = float(second)
        replica.churn_one_second(churn)
        for path, (build, apply) in paths.items():
            digest = timed(path, "build", build)
            data = timed(path, "pickle", lambda: pickle.dumps(digest))
            timed(path, "ray_str", lambda: str(digest))
            received = timed(path, "unpickle", lambda: pickle.loads(data))
            timed(path, "apply", lambda: apply(received))
            num_bytes[path] += len(data)
    for mirror in mirrors.values():
        assert mirror.in_sync and mirror.block_hashes == set(replica.block_manager.cached), \
            "the mirror drifted from the cache"
    events = replica.block_manager.kv_events.since(first_seq)
    num_stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    num_removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
    per_s = {path: {"bytes": num_bytes[path] / seconds,
                    "cpu_ms": {s: 1e3 * t / seconds for s, t in cpu[path].items()},
                    "cpu_ms_total": 1e3 * sum(cpu[path].values()) / seconds}
             for path in paths}
    return {"num_blocks": num_blocks, "num_cached": len(replica.block_manager.cached),
            "seconds": seconds, "blocks_stored_per_s": num_stored / seconds,
            "blocks_removed_per_s": num_removed / seconds, "events_per_s": len(events) / seconds,
            "per_s": per_s,
            "ratios": {path: ratios(per_s["snapshot"], per_s[path]) for path in mirrors}}


def ratios(baseline: dict, other: dict) -> dict:
    return {"bytes": baseline["bytes"] / other["bytes"],
            "cpu": baseline["cpu_ms_total"] / other["cpu_ms_total"]}


def print_result(r: dict) -> None:
    print(f"\n{r['num_cached']:,} cached blocks; churn {r['blocks_stored_per_s']:.0f} stored + "
          f"{r['blocks_removed_per_s']:.0f} removed blocks/s ({r['events_per_s']:.0f} events/s), "
          f"{r['seconds']} s simulated, one report a second")
    print(f"{'path':10} {'KB/s':>8} " + " ".join(f"{s:>9}" for s in STAGES) + f" {'CPU ms/s':>9}")
    for path, p in r["per_s"].items():
        print(f"{path:10} {p['bytes'] / 1e3:8.1f} "
              + " ".join(f"{p['cpu_ms'][s]:9.3f}" for s in STAGES) + f" {p['cpu_ms_total']:9.3f}")
    for path, ratio in r["ratios"].items():
        print(f"snapshot / {path}: bytes x{ratio['bytes']:.1f}, CPU x{ratio['cpu']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--seconds", type=int, default=120)
    parser.add_argument("--churn", type=int, default=300, help="unique blocks stored per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = []
    for num_blocks in args.blocks:
        results.append(run_one(num_blocks, args.seconds, args.churn, args.seed))
        print_result(results[-1])
    path = write_result("kv_events", {"block_size": BLOCK_SIZE, "churn": args.churn,
                                      "results": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
