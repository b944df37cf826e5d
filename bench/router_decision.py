"""The prefix-affinity router's cost per decision, at 10, 100 and 1,000 replicas; with
`--baseline-ref`, against the router of an earlier commit of this repository, on the same fleet and
the same requests.

Each replica holds the contexts of a few tenants (llm-d shaped: a 6,000-token context per tenant,
1,200-token queries), has `--in-flight` requests of this router in flight, and reported a digest.
A decision is what the ingress does per request: the shim's work (the current ingress observes
digests and retains the live set when the set changes; `--baseline-shim per-request` does that on
every request, as the ingress did before the inverted index), `choose`, the first rank, and the
request's bookkeeping until it completes. A share of the requests are cold (a prefix no replica
holds), which the rendezvous home decides. The current index leaves the per-hash TTL stamps of its
optimistic inserts, the long fresh tails of cold ones (`lazy tails`), and the bookkeeping of the
runs a decision remembered (the pointers that forget a run when one of its blocks changes holders)
to the next digest of the replica (off the request path); that deferred work is timed at the end
and reported per request beside the decisions.

Each router runs alone in a process of its own, as an ingress runs it, timed in CPU time; the
baseline's is the source tree at the ref (`git archive`, unpacked in a temporary directory and
imported from there), and the two alternate which goes first from one fleet size to the next.

    python -m bench.router_decision [--replicas 10,100,1000] [--requests 2000] [--in-flight 48]
                                    [--baseline-ref REF [--baseline-shim per-request|on-change]]
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import cpu_info, write_result

REPO = Path(__file__).resolve().parents[1]

BLOCK_SIZE = 16
CONTEXT_BLOCKS = 6000 // BLOCK_SIZE
QUERY_BLOCKS = (1200 + 128) // BLOCK_SIZE


def _import_first(*names: str):
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not name.startswith(e.name or "\0"):
                raise  # the module exists but one of its own imports is missing
    raise ModuleNotFoundError(f"none of {names}")


def load_router(src: Path) -> SimpleNamespace:
    """The router of the source tree at src, imported from there (this checkout's own editable
    install is taken off the import path first, so that nothing resolves to this checkout). The
    tree's layout is that of its commit: `pagedserve.serve_app`, or top-level `serve_app` before."""
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path_hooks[:] = [h for h in sys.path_hooks
                         if not getattr(h, "__module__", "").startswith("__editable__")]
    sys.path_importer_cache.clear()
    sys.path.insert(0, str(src))
    prefixes = ("pagedserve.", "")
    names = lambda *tails: [p + t for p in prefixes for t in tails]  # noqa: E731
    router_state = _import_first(*names("serve_app.routing.router_state"))
    policy = _import_first(*names("serve_app.routing.policy"))
    digest = _import_first(*names("replicas.core.cache_digest", "replicas.cache_digest"))
    events = _import_first(*names("replicas.core.kv_events", "replicas.kv_events"))
    for module in (router_state, policy, digest, events):
        if not Path(module.__file__).resolve().is_relative_to(src.resolve()):
            raise RuntimeError(f"{module.__name__} came from {module.__file__}, not from {src}")
    return SimpleNamespace(RouterState=router_state.RouterState,
                           RoutingSettings=policy.RoutingSettings,
                           DIGEST_VERSION=digest.DIGEST_VERSION, KVSnapshot=events.KVSnapshot,
                           wire_stream=events.wire_stream)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def build_fleet(router: SimpleNamespace, num_replicas: int, num_tenants: int,
                tenants_per_replica: int, rng: random.Random):
    ids = [f"replica-{i:05d}" for i in range(num_replicas)]
    # Random 63-bit hashes, as real chained block hashes are (structured integers collide in the
    # low bits that dicts and sets index by).
    contexts = [[rng.getrandbits(63) for _ in range(CONTEXT_BLOCKS)] for _ in range(num_tenants)]
    digests = {}
    for replica_id in ids:
        held = [h for t in rng.sample(range(num_tenants), tenants_per_replica) for h in contexts[t]]
        digests[replica_id] = {"version": router.DIGEST_VERSION, "time": 999.0,
                               "block_size": BLOCK_SIZE,
                               "kv_events": router.wire_stream(0, [], router.KVSnapshot(0, held)),
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


def make_state(router: SimpleNamespace, ids, digests, in_flight: int, seed: int):
    clock = Clock()
    state = router.RouterState(router.RoutingSettings(), rng=random.Random(seed), clock=clock)
    for replica_id in ids:
        state.observe(replica_id, digests[replica_id])
    for replica_id in ids:  # requests in flight, sent since the digest
        for j in range(in_flight):
            state.loads.sent(f"{replica_id}/{j}", replica_id, clock.now)
    return state, clock


def decide(state, clock, ids, digests, request_id: str, hashes, per_request_shim: bool) -> str:
    if per_request_shim:  # every digest, then the live set, on every request
        for replica_id in ids:
            state.observe(replica_id, digests[replica_id])
        state.retain(ids)
    # Otherwise the shim maps and retains only when Ray's candidate list changes, and passes the
    # same tuple of ids until then.
    first = state.choose(request_id, hashes, ids).replica_id
    if hasattr(state, "routed"):  # routers that count a request once Ray has routed it
        state.routed(request_id, first)
    state.completed(request_id)
    clock.now += 1e-4
    return first


def settle(state, ids) -> None:
    """What the index leaves to the replicas' next digests, where it leaves anything."""
    index = state.index
    if hasattr(index, "runs"):
        index.runs.settle()
    for replica_id in ids:
        if hasattr(index, "_enter_lazy"):
            index._enter_lazy(replica_id)
        if hasattr(index, "_stamped"):
            index._stamped(replica_id)


def measure(router: SimpleNamespace, num_replicas: int, args, per_request_shim: bool) -> dict:
    """One router's decisions on the fleet and requests that args.seed makes."""
    rng = random.Random(args.seed)
    ids, contexts, digests = build_fleet(router, num_replicas, args.tenants,
                                         args.tenants_per_replica, rng)
    stream = requests(contexts, args.requests, args.cold_fraction, rng)
    state, clock = make_state(router, ids, digests, args.in_flight, args.seed)
    live = tuple(ids)
    times = []
    for i, hashes in enumerate(stream):
        began = time.thread_time()  # CPU time: other processes on these cores do not count
        decide(state, clock, live, digests, f"q{i}", hashes, per_request_shim)
        times.append(time.thread_time() - began)
    began = time.thread_time()
    settle(state, ids)
    deferred = (time.thread_time() - began) / len(stream)
    return {"us_p50": percentile(times, 0.5) * 1e6, "us_p99": percentile(times, 0.99) * 1e6,
            "deferred_us_per_request": deferred * 1e6}


def run_child(src: Path, num_replicas: int, args, per_request_shim: bool) -> dict:
    """measure() in a fresh process importing the router from src."""
    argv = [sys.executable, "-m", "bench.router_decision", "--child-src", str(src),
            "--replicas", str(num_replicas), "--requests", str(args.requests),
            "--in-flight", str(args.in_flight), "--tenants", str(args.tenants),
            "--tenants-per-replica", str(args.tenants_per_replica),
            "--cold-fraction", str(args.cold_fraction), "--seed", str(args.seed)]
    if per_request_shim:
        argv.append("--child-per-request-shim")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"the router of {src} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def unpack_ref(ref: str, into: Path) -> str:
    """The source tree of `ref` (a commit, tag or branch of this repository) unpacked into `into`;
    returns the commit. Reads the repository only."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit],
                             check=True, capture_output=True).stdout
    tar_path = into / "tree.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        if hasattr(tarfile, "data_filter"):  # Pythons with extraction filters
            tar.extractall(into / "src", filter="data")
        else:
            tar.extractall(into / "src")
    tar_path.unlink()
    return commit


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
    p.add_argument("--baseline-ref", help="a commit, tag or branch of this repository whose router "
                   "to time beside the current one (e.g. the commit before the inverted index: "
                   "`git log -- serve_app/routing/prefix_index.py`)")
    p.add_argument("--baseline-shim", choices=["per-request", "on-change"], default="per-request",
                   help="when the baseline's ingress observed the digests and retained the live "
                        "set (default: on every request, as before the inverted index)")
    p.add_argument("--child-src", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-per-request-shim", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_src is not None:  # one router, one fleet size: a JSON line back
        router = load_router(args.child_src)
        result = measure(router, int(args.replicas), args, args.child_per_request_shim)
        print(json.dumps(result))
        return result
    cpu = cpu_info()
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in cpu.get("flags", ())]
    print(f"CPU: {cpu.get('model', cpu)} ({', '.join(flags)}), load average "
          f"{os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="router-baseline-") as tmp:
        systems = {"current": (REPO, False)}
        baseline_commit = None
        if args.baseline_ref:
            baseline_commit = unpack_ref(args.baseline_ref, Path(tmp))
            systems["baseline"] = (Path(tmp) / "src", args.baseline_shim == "per-request")
            print(f"baseline: {args.baseline_ref} ({baseline_commit}), shim {args.baseline_shim}")
        for k, num in enumerate(int(n) for n in args.replicas.split(",")):
            order = list(systems) if k % 2 == 0 else list(reversed(systems))
            results = {name: run_child(systems[name][0], num, args, systems[name][1])
                       for name in order}
            row = {"replicas": num, "in_flight": num * args.in_flight}
            for name, result in results.items():
                row.update({f"{name}_{key}": value for key, value in result.items()})
            line = (f"{num:>5} replicas: current p50/p99 {row['current_us_p50']:6.1f}/"
                    f"{row['current_us_p99']:6.1f} us"
                    f" (+{row['current_deferred_us_per_request']:.1f} us/request at digests)")
            if "baseline" in results:
                row["speedup_p50"] = row["baseline_us_p50"] / row["current_us_p50"]
                row["speedup_p99"] = row["baseline_us_p99"] / row["current_us_p99"]
                line += (f"   baseline {row['baseline_us_p50']:8.1f}/"
                         f"{row['baseline_us_p99']:8.1f} us"
                         f"   x{row['speedup_p50']:.1f} / x{row['speedup_p99']:.1f}")
            row["load_average_1m"] = os.getloadavg()[0]  # other work on these cores, as it ended
            rows.append(row)
            print(f"{line}   load {row['load_average_1m']:.2f}", flush=True)
    path = write_result("router_decision", {"args": {**vars(args), "child_src": None},
                                            "baseline_commit": baseline_commit, "rows": rows})
    print(f"wrote {path}")
    return {"rows": rows}

if __name__ == "__main__":
    main()
