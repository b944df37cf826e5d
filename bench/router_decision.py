"""The prefix-affinity router's cost per decision, at 10, 100 and 1,000 replicas, against the
algorithm it replaced (`bench.router_baseline`), both measured in this run on the same fleet and
the same requests, alternating request by request.

Each replica holds the contexts of a few tenants (llm-d shaped: a 6,000-token context per tenant,
1,200-token queries), has `--in-flight` requests of this router in flight, and reported a digest.
A decision is what the ingress does per request: the shim's work (the old one observed every
digest and retained the live set per request; the current one does that when the set changes),
`choose`, the first rank, and `routed`/`completed`. A share of the requests are cold (a prefix no
replica holds), which the rendezvous home decides. The current index leaves the per-hash TTL
stamps of its optimistic inserts, the long fresh tails of cold ones (`lazy tails`), and the
bookkeeping of the runs a decision remembered (the pointers that forget a run when one of its
blocks changes holders) to the next digest of the replica (off the request path); that deferred
work is timed at the end and reported per request beside the decisions. Then the current router
runs the same requests again alone (`current alone`), as an ingress runs it: interleaved, the old
algorithm's garbage sets off collections that land in the current one's decisions.

    python -m bench.router_decision [--replicas 10,100,1000] [--requests 2000] [--in-flight 48]
"""
from __future__ import annotations

import argparse
import os
import random
import time

from bench.common import cpu_info, write_result
from bench.router_baseline import OldRouterState
from replicas.cache_digest import DIGEST_VERSION
from replicas.kv_events import KVSnapshot, wire_stream
from serve_app.routing.policy import RoutingSettings
from serve_app.routing.router_state import RouterState

BLOCK_SIZE = 16
CONTEXT_BLOCKS = 6000 // BLOCK_SIZE
QUERY_BLOCKS = (1200 + 128) // BLOCK_SIZE


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def build_fleet(num_replicas: int, num_tenants: int, tenants_per_replica: int, rng: random.Random):
    ids = [f"replica-{i:05d}" for i in range(num_replicas)]
    # Random 63-bit hashes, as real chained block hashes are (structured integers collide in the
    # low bits that dicts and sets index by).
    contexts = [[rng.getrandbits(63) for _ in range(CONTEXT_BLOCKS)] for _ in range(num_tenants)]
    digests = {}
    for replica_id in ids:
        held = [h for t in rng.sample(range(num_tenants), tenants_per_replica) for h in contexts[t]]
        digests[replica_id] = {"version": DIGEST_VERSION, "time": 999.0, "block_size": BLOCK_SIZE,
                               "kv_events": wire_stream(0, [], KVSnapshot(0, held)),
                               "num_waiting": 0, "num_running": 0, "kv_cache_usage": 0.5,
                               "prefix_cache_hit_rate": 0.0}
    return ids, contexts, digests


def requests(contexts, num: int, cold_fraction: float, rng: random.Random):
    out = []
    for _ in range(num):
        context = [] if rng.random() < cold_fraction else rng.choice(contexts)
        blocks = QUERY_BLOCKS if context else CONTEXT_BLOCKS + QUERY_BLOCKS
        out.append(context + [rng.getrandbits(63) for _ in range(blocks)])
    return out


def make_state(kind: str, ids, digests, in_flight: int, seed: int):
    clock = Clock()
    settings = RoutingSettings()
    state = (RouterState(settings, rng=random.Random(seed), clock=clock) if kind == "current"
             else OldRouterState(settings, rng=random.Random(seed), clock=clock))
    for replica_id in ids:
        state.observe(replica_id, digests[replica_id])
    for replica_id in ids:  # requests in flight, sent since the digest
        for j in range(in_flight):
            state.loads.sent(f"{replica_id}/{j}", replica_id, clock.now)
    return state, clock


def decide(kind: str, state, clock, ids, digests, request_id: str, hashes) -> str:
    if kind == "old":  # the old shim, per request: every digest, then the live set
        for replica_id in ids:
            state.observe(replica_id, digests[replica_id])
        state.retain(ids)
        ranked, _, _ = state.choose(request_id, hashes, ids)
        first = ranked[0]
    else:  # the current shim maps and retains only when Ray's candidate list changes, and passes
        # the same tuple of ids until then
        first = next(state.choose(request_id, hashes, ids).ranking())
    state.routed(request_id, first)
    state.completed(request_id)
    clock.now += 1e-4
    return first


def measure(num_replicas: int, args) -> dict:
    rng = random.Random(args.seed)
    ids, contexts, digests = build_fleet(num_replicas, args.tenants, args.tenants_per_replica, rng)
    stream = requests(contexts, args.requests, args.cold_fraction, rng)
    states = {kind: make_state(kind, ids, digests, args.in_flight, args.seed)
              for kind in ("old", "current")}
    times: dict[str, list[float]] = {kind: [] for kind in states}
    live = {"old": ids, "current": tuple(ids)}
    for i, hashes in enumerate(stream):
        order = ("old", "current") if i % 2 == 0 else ("current", "old")
        for kind in order:
            state, clock = states[kind]
            began = time.thread_time()  # CPU time: other processes on these cores do not count
            decide(kind, state, clock, live[kind], digests, f"q{i}", hashes)
            times[kind].append(time.thread_time() - began)
    began = time.thread_time()
    index = states["current"][0].index
    index.runs.settle()  # what the next digests would do first
    for replica_id in ids:
        index._enter_lazy(replica_id)
        index._stamped(replica_id)
    deferred = (time.thread_time() - began) / len(stream)
    result = {"replicas": num_replicas, "in_flight": num_replicas * args.in_flight,
              "current_deferred_us_per_request": deferred * 1e6}
    for kind, values in times.items():
        result[f"{kind}_us_p50"] = percentile(values, 0.5) * 1e6
        result[f"{kind}_us_p99"] = percentile(values, 0.99) * 1e6
    result["speedup_p50"] = result["old_us_p50"] / result["current_us_p50"]
    result["speedup_p99"] = result["old_us_p99"] / result["current_us_p99"]
    # Alone: the interleaved figures include the collections that the old algorithm's garbage
    # triggers in this process; an ingress runs only the current router.
    del states
    state, clock = make_state("current", ids, digests, args.in_flight, args.seed)
    alone = []
    for i, hashes in enumerate(stream):
        began = time.thread_time()
        decide("current", state, clock, live["current"], digests, f"q{i}", hashes)
        alone.append(time.thread_time() - began)
    result["current_alone_us_p50"] = percentile(alone, 0.5) * 1e6
    result["current_alone_us_p99"] = percentile(alone, 0.99) * 1e6
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.router_decision",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="10,100,1000")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--in-flight", type=int, default=48, help="per replica")
    p.add_argument("--tenants", type=int, default=150)
    p.add_argument("--tenants-per-replica", type=int, default=3)
    p.add_argument("--cold-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cpu = cpu_info()
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in cpu.get("flags", ())]
    print(f"CPU: {cpu.get('model', cpu)} ({', '.join(flags)}), load average "
          f"{os.getloadavg()[0]:.2f}")
    rows = []
    for num in [int(n) for n in args.replicas.split(",")]:
        row = measure(num, args)
        row["load_average_1m"] = os.getloadavg()[0]  # other work on these cores, as it ended
        rows.append(row)
        print(f"{num:>5} replicas: old p50/p99 {row['old_us_p50']:8.1f}/{row['old_us_p99']:8.1f} us"
              f"   current {row['current_us_p50']:6.1f}/{row['current_us_p99']:6.1f} us"
              f"   x{row['speedup_p50']:.1f} / x{row['speedup_p99']:.1f}"
              f"   (+{row['current_deferred_us_per_request']:.1f} us/request at digests)"
              f"   current alone {row['current_alone_us_p50']:.1f}/{row['current_alone_us_p99']:.1f} us"
              f"   load {row['load_average_1m']:.2f}",
              flush=True)
    path = write_result("router_decision", {"args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
