"""Soak: mixed load on the real app for N minutes, an engine replica killed half-way.

    python -m bench.soak --minutes 10          # the figures for a release note
    python -m bench.soak --minutes 1           # what the test suite runs

Load (each of --concurrency workers, in a loop): streamed completions over a few shared prefixes,
whole chat completions, n=2 with logprobs, streams cancelled mid-way, and bad requests. Passes
when every request ended with a response or a clean OpenAI-shaped error, no 5xx came but for the
requests in flight on the killed replica, every replica holds zero KV blocks and zero requests at
idle, and no serving process grew its RSS by more than 5 % after warm-up (the first fifth of the
run, at least 30 s). Writes bench/results/soak.json; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.common import free_port, write_result
from bench.serving_overhead import build_tiny

APP = "pagedserve"
RSS_GROWTH_LIMIT = 0.05
SAMPLE_EVERY_S = 5.0
LOADING_JUMP = 1.1  # a sample 10 % above the one before: a process still loading its model
# Per replica. The ingress mirrors every replica's cached block hashes for routing (a set entry
# and an index entry each), so its memory grows until the replicas' caches are full: 0.25 GiB of
# the tiny model's KV (21,845 blocks each) took longer than the warm-up to fill, and that growth
# read as a leak; 2,048 blocks (a 32-sequence batch needs ~320) fill within seconds and keep
# eviction busy.
KV_BLOCKS = 2048
# A replica's death is seen by the routers within a few seconds: requests sent to it meanwhile
# fail like the ones in flight on it.
KILL_WINDOW_S = 5.0
PREFIXES = ["You are a helpful assistant. " * 6, "Translate the following text into French: " * 4,
            "Summarize the paged attention paper in one line: " * 3]
BAD_REQUESTS = [  # (route, body): each must be a 4xx with an OpenAI-shaped error
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 100}),
    ("/v1/completions", {"prompt": "hi", "temperature": 9}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 10_000}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}),
]


@dataclass
class Outcome:
    kind: str
    start: float
    end: float
    status: int | None  # None: the connection failed
    clean: bool  # a response, or an OpenAI-shaped error (in-band for a stream)


@dataclass
class Soak:
    model: str
    deadline: float
    kill_at: float
    killed_at: float | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def prompt(self) -> str:
        return self.rng.choice(PREFIXES) + " ".join(self.rng.choice(["fox", "dog", "cache", "token",
                                                                       "block", "ray"])
                                                     for _ in range(self.rng.randint(1, 30)))

    async def stream(self, http: httpx.AsyncClient, cancel_after: int | None) -> tuple[int, bool]:
        body = {"model": self.model, "prompt": self.prompt(), "stream": True, "ignore_eos": True,
                "max_tokens": self.rng.randint(8, 96)}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return response.status_code, _is_openai_error(json.loads(await response.aread()))
            events = 0
            last = ""
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    last = line
                    if cancel_after is not None and events >= cancel_after:
                        return 200, True  # left mid-stream: the server must free its blocks
            done = last == "data: [DONE]"
            return 200, done  # an error event before [DONE] is clean too

    async def one(self, http: httpx.AsyncClient) -> None:
        kind = self.rng.choices(["stream", "chat", "n2", "cancel", "bad"], [5, 3, 1, 2, 1])[0]
        start = time.monotonic()
        try:
            if kind in ("stream", "cancel"):
                status, clean = await self.stream(http, self.rng.randint(1, 4) if kind == "cancel"
                                                  else None)
            else:
                route, body = {
                    "chat": ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": self.prompt()}],
                              "max_tokens": self.rng.randint(4, 48)}),
                    "n2": ("/v1/completions", {"prompt": self.prompt(), "n": 2, "logprobs": 2,
                                               "max_tokens": 16, "temperature": 0.8, "seed": 1}),
                    "bad": self.rng.choice(BAD_REQUESTS),
                }[kind]
                response = await http.post(route, json={"model": self.model, **body})
                status = response.status_code
                payload = response.json()
                clean = ("choices" in payload) if status == 200 else _is_openai_error(payload)
                if kind == "bad":
                    clean = clean and 400 <= status < 500
        except (httpx.HTTPError, json.JSONDecodeError):
            status, clean = None, False
        self.outcomes.append(Outcome(kind, start, time.monotonic(), status, clean))

    async def worker(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline:
            await self.one(http)

    def allowed_5xx(self, o: Outcome) -> bool:
        """In flight on the killed replica (or sent to it before the routers saw it die)."""
        return (self.killed_at is not None and o.start <= self.killed_at + KILL_WINDOW_S
                and o.end >= self.killed_at)


def _is_openai_error(payload) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def serving_processes() -> dict[int, str]:
    import psutil
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0].startswith(("ray::ServeReplica", "ray::ProxyActor")):
            found[child.pid] = cmd[0].split()[0].split(".")[0]  # without the method it runs now
    return found


def rss_mb(pid: int) -> float | None:
    import psutil
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


async def sample_rss(soak: Soak, samples: dict[int, list[tuple[float, float]]], names: dict) -> None:
    while time.monotonic() < soak.deadline:
        now = time.monotonic()
        for pid, name in serving_processes().items():
            names[pid] = name
            value = rss_mb(pid)
            if value is not None:
                samples.setdefault(pid, []).append((now, value))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def kill_one_replica(soak: Soak) -> None:
    import ray
    await asyncio.sleep(max(0.0, soak.kill_at - time.monotonic()))
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if f"{APP}#EngineReplica#" in a["name"]]
    ray.kill(ray.get_actor(sorted(names)[0], namespace="serve"), no_restart=True)
    soak.killed_at = time.monotonic()
    print(f"killed {sorted(names)[0]}", file=sys.stderr)


def idle_replicas(num_replicas: int, timeout_s: float = 60.0) -> list[dict]:
    """Every replica's stats once all are idle (or the last seen, after timeout_s)."""
    from ray import serve
    handle = serve.get_deployment_handle("EngineReplica", APP)
    deadline = time.monotonic() + timeout_s
    while True:
        seen: dict[str, dict] = {}
        for _ in range(20 * num_replicas):
            stats = handle.stats.remote().result()
            seen[stats["replica_id"]] = stats
            if len(seen) == num_replicas:
                break
        idle = all(s["num_requests"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
                   for s in seen.values())
        if (idle and len(seen) == num_replicas) or time.monotonic() > deadline:
            return list(seen.values())
        time.sleep(1.0)


def rss_growth(samples: dict[int, list[tuple[float, float]]], names: dict, warm_until: float,
               own_warm_up_s: float) -> dict:
    """RSS at the end vs after warm-up, per process; one started late (the killed replica's
    successor) warms up for own_warm_up_s from the end of its loading (its last jump of more
    than LOADING_JUMP in one sample: a model loads in seconds to a minute, depending on load)."""
    growth = {}
    first_round = min((points[0][0] for points in samples.values()), default=0.0)
    for pid, points in samples.items():
        late = points[0][0] > first_round + SAMPLE_EVERY_S
        loaded = max((t for (t, v), (_, before) in zip(points[1:], points) if v > before * LOADING_JUMP),
                     default=points[0][0])
        warm = max(warm_until, loaded + own_warm_up_s) if late else warm_until
        after = [v for t, v in points if t >= warm]
        if len(after) >= 2:
            # A value a minute shows the curve: a plateau (allocator pools filling) or a slope.
            per_minute = [round(v, 1) for i, v in enumerate(after) if i % int(60 / SAMPLE_EVERY_S) == 0]
            growth[f"{names[pid]}[{pid}]"] = {"warm_mb": round(after[0], 1),
                                             "end_mb": round(after[-1], 1),
                                             "growth": round(after[-1] / after[0] - 1, 4),
                                             "per_minute_mb": per_minute}
    return growth


async def drive(soak: Soak, base_url: str, concurrency: int, samples, names,
                timeout_s: float) -> None:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as http:
        await asyncio.gather(kill_one_replica(soak), sample_rss(soak, samples, names),
                             *(soak.worker(http) for _ in range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default="tiny", help="HF directory, or 'tiny' (the default)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--http", choices=("direct", "proxy"), default="direct",
                        help="HTTP served by the ingress replicas (the default) or Ray Serve's proxy")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="client timeout: a request that takes longer counts as hung")
    args = parser.parse_args()
    if args.model == "tiny":
        args.model = build_tiny(tempfile.mkdtemp(prefix="bench-soak-tiny-"))

    import ray
    from ray import serve

    from pagedserve.serve_app import build_app
    from pagedserve.serve_app.app import start_serve
    from pagedserve.serve_app.config import ServeSettings

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    settings = ServeSettings.from_args({
        "model": args.model, "num_replicas": args.replicas,
        "replica_num_cpus": 2 / (args.replicas + 1), "num_threads": 1,
        "served_model_name": "soak", "max_num_seqs": 32, "num_kv_blocks": KV_BLOCKS,
        "health_check_period_s": 1.0, "host": "127.0.0.1", "port": port,
        "direct_http": args.http == "direct"})
    serve.run(build_app(start_serve(settings)), name=APP, route_prefix="/")
    began = time.monotonic()
    duration = args.minutes * 60
    soak = Soak("soak", began + duration, began + duration / 2)
    samples: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, str] = {}
    try:
        asyncio.run(drive(soak, f"http://127.0.0.1:{port}", args.concurrency, samples, names,
                          args.timeout_s))
        idle = idle_replicas(args.replicas)
    finally:
        serve.shutdown()
        ray.shutdown()

    outcomes = soak.outcomes
    unclean = [o for o in outcomes if not o.clean and not (o.status and o.status >= 500
                                                           and soak.allowed_5xx(o))]
    server_errors = [o for o in outcomes if o.status and o.status >= 500]
    stray_5xx = [o for o in server_errors if not soak.allowed_5xx(o)]
    # Warm-up: a fifth of the run, at least half a minute of a short one; a process started later
    # (the killed replica's successor) warms up a minute from when it was first seen (loading).
    warm_up_s = max(duration / 5, min(duration / 2, 30.0))
    growth = rss_growth(samples, names, began + warm_up_s, own_warm_up_s=max(warm_up_s, 60.0))
    grew = {k: v for k, v in growth.items() if v["growth"] > RSS_GROWTH_LIMIT}
    leaked = [s for s in idle if s["num_requests"] or s["kv_blocks_free"] != s["kv_blocks_total"]]
    checks = {"every request ended cleanly": not unclean,
              "no 5xx but the killed replica's": not stray_5xx,
              "zero KV blocks and requests at idle": not leaked and len(idle) == args.replicas,
              f"RSS growth under {RSS_GROWTH_LIMIT:.0%} after warm-up": not grew}
    result = {
        "minutes": args.minutes, "replicas": args.replicas, "concurrency": args.concurrency,
        "requests": len(outcomes), "requests_per_s": round(len(outcomes) / duration, 1),
        "by_kind": dict(Counter(o.kind for o in outcomes)),
        "by_status": {str(k): v for k, v in Counter(o.status for o in outcomes).items()},
        "killed_at_s": round(soak.killed_at - began, 1) if soak.killed_at else None,
        "5xx_in_flight_on_killed_replica": len(server_errors) - len(stray_5xx),
        "unclean": [{**o.__dict__, "start": round(o.start - began, 2), "end": round(o.end - began, 2)}
                    for o in unclean[:20]],
        "stray_5xx": len(stray_5xx),
        "idle_replicas": [{k: s[k] for k in ("replica_id", "num_requests", "kv_blocks_free",
                                             "kv_blocks_total")} for s in idle],
        "rss": growth, "checks": checks,
    }
    path = write_result("soak", result)
    print(json.dumps({k: result[k] for k in ("requests", "requests_per_s", "by_kind", "by_status",
                                             "5xx_in_flight_on_killed_replica", "stray_5xx")}))
    for name, values in growth.items():
        print(f"  {name}: {values['warm_mb']} -> {values['end_mb']} MB ({values['growth']:+.1%}); "
              f"each minute {values['per_minute_mb']}")
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    print(f"wrote {path}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
