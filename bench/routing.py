"""Prefix-affinity routing vs routing by load alone, on a shared-prefix chat workload.

Several system prompts of about 512 tokens, each followed by many short user turns, arrive
interleaved (Poisson arrivals) at an OpenAI-compatible app with 2 engine replicas on this machine.
The same workload runs twice in one process: once with the ingress's prefix-affinity router, once
with `prefix_affinity=false` (power of two choices by load, Ray Serve's default router's rule),
each on fresh replicas. Each replica's KV cache holds only
part of all the system prompts (`--cache-fraction`), as in production, where affinity matters.

Prints the cluster prefix-cache hit rate (from `usage.prompt_tokens_details.cached_tokens`) next to
the single-replica ideal (the same prompts replayed through one unbounded prefix cache), TTFT
p50/p90 and throughput for both routers, and the ratios; writes bench/results/routing.json.

    python -m bench.routing [--replicas 2] [--system-prompts 8] [--turns 10] [--rate 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass

from bench.common import free_port, write_result
from pagedserve.replicas.core.block_hash import block_hashes

APP_NAME = "pagedserve"
# The router's settings for each run: ours, and load alone (power of two choices, prefixes
# ignored, as Ray Serve's default router routes).
ROUTERS = {"prefix_affinity": {}, "default": {"prefix_affinity": False}}


@dataclass
class Turn:
    system_index: int
    messages: list[dict]
    arrival_s: float
    prompt_token_ids: list[int] | None = None


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


def ideal_cached_tokens(prompts: list[list[int]], block_size: int) -> list[int]:
    """Prompt tokens one replica with an unbounded prefix cache would serve from cache, in order:
    each prompt's longest run of leading full blocks seen before (never its last token)."""
    seen: set[int] = set()
    cached = []
    for tokens in prompts:
        hashes = block_hashes(tokens, block_size)
        limit = (len(tokens) - 1) // block_size
        num = 0
        while num < min(limit, len(hashes)) and hashes[num] in seen:
            num += 1
        cached.append(num * block_size)
        seen.update(hashes)
    return cached


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def build_model(args) -> str:
    from tests.tiny_models import build_tiny_model

    out = tempfile.mkdtemp(prefix="bench-routing-")
    build_tiny_model(out, "llama", num_layers=args.layers, hidden_size=args.hidden_size,
                     num_heads=8, num_kv_heads=4, max_position_embeddings=2048)
    return out


def make_workload(args) -> list[Turn]:
    from tests.tiny_models import _WORDS

    rng = random.Random(args.seed)
    words = [w for w in _WORDS if w.isascii()]
    # ~1.3 tokens a word with the test tokenizer: aim a little short of system_tokens
    num_words = int(args.system_tokens / 1.35)
    systems = [f"You are assistant number {i}. " + " ".join(rng.choice(words) for _ in range(num_words))
               for i in range(args.system_prompts)]
    turns = [(s, t) for s in range(args.system_prompts) for t in range(args.turns)]
    rng.shuffle(turns)  # interleaved
    arrival = 0.0
    workload = []
    for s, t in turns:
        user = f"question {t}: " + " ".join(rng.choice(words) for _ in range(rng.randint(6, 16)))
        workload.append(Turn(s, [{"role": "system", "content": systems[s]},
                                 {"role": "user", "content": user}], arrival))
        arrival += rng.expovariate(args.rate)
    return workload


def settings(args, model_dir: str, router: dict) -> dict:
    blocks_per_prompt = -(-args.system_tokens // args.block_size)
    num_kv_blocks = int(args.cache_fraction * args.system_prompts * blocks_per_prompt) \
        + args.max_num_seqs * 4
    return dict(model=model_dir, served_model_name="bench", num_replicas=args.replicas,
                replica_num_cpus=0.5, num_threads=1, block_size=args.block_size,
                max_model_len=1024, max_num_seqs=args.max_num_seqs, num_kv_blocks=num_kv_blocks,
                request_router_kwargs=router)


async def tokenize_all(base_url: str, workload: list[Turn]) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for turn in workload:
            r = await client.post("/tokenize", json={"model": "bench", "messages": turn.messages})
            r.raise_for_status()
            turn.prompt_token_ids = r.json()["tokens"]


async def one_request(client, turn: Turn, args, t0: float) -> Result:
    body = {"model": "bench", "messages": turn.messages, "max_tokens": args.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = Result(ok=False, start_s=start - t0)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                for choice in chunk.get("choices", []):
                    if not result.ttft_s and (choice.get("delta", {}).get("content")
                                              or choice.get("finish_reason")):
                        result.ttft_s = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.completion_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens", 0)
    except Exception as exc:  # a benchmark reports failures, it does not stop on them
        result.error = repr(exc)
        return result
    end = time.perf_counter()
    result.ok, result.e2e_s, result.end_s = True, end - start, end - t0
    return result


async def run_workload(base_url: str, workload: list[Turn], args) -> list[Result]:
    import httpx

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def scheduled(turn: Turn) -> Result:
            await asyncio.sleep(max(0.0, turn.arrival_s - (time.perf_counter() - t0)))
            return await one_request(client, turn, args, t0)

        return await asyncio.gather(*(scheduled(turn) for turn in workload))


async def warm_up(base_url: str, num: int) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        body = lambda i: {"model": "bench", "messages": [{"role": "user", "content": f"warm {i}"}],
                          "max_tokens": 2}
        await asyncio.gather(*(client.post("/v1/chat/completions", json=body(i)) for i in range(num)))


def summarize(results: list[Result], ideal: list[int], prompt_lens: list[int]) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    makespan = max(r.end_s for r in ok) - min(r.start_s for r in ok) if ok else float("nan")
    output_tokens = sum(r.completion_tokens for r in ok)
    return {
        "num_requests": len(results), "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in ok) / max(prompt_tokens, 1),
        "ideal_hit_rate": sum(ideal) / sum(prompt_lens),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
        "e2e_p50_s": percentile([r.e2e_s for r in ok], 0.5),
        "output_tokens_per_s": output_tokens / makespan, "requests_per_s": len(ok) / makespan,
        "makespan_s": makespan,
    }


def run_router(args, model_dir: str, router: dict, workload: list[Turn], base_url: str) -> list[Result]:
    from ray import serve

    from pagedserve.serve_app import build_app

    serve.run(build_app(settings(args, model_dir, router)), name=APP_NAME, route_prefix="/")
    try:
        asyncio.run(warm_up(base_url, 2 * args.replicas))
        if workload[0].prompt_token_ids is None:
            asyncio.run(tokenize_all(base_url, workload))
        return asyncio.run(run_workload(base_url, workload, args))
    finally:
        serve.delete(APP_NAME)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--turns", type=int, default=10, help="user turns per system prompt")
    parser.add_argument("--rate", type=float, default=2.0,
                        help="arrivals per second (Poisson); at 2/s both routers keep up here")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-fraction", type=float, default=0.75,
                        help="share of all system prompts one replica's KV cache holds")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--model", default=None, help="a local HF checkpoint (default: a random one)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    model_dir = args.model or build_model(args)
    workload = make_workload(args)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs = {}
    try:
        for name, router in ROUTERS.items():
            print(f"running {len(workload)} requests with the {name} router ...", flush=True)
            runs[name] = run_router(args, model_dir, router, workload, base_url)
    finally:
        serve.shutdown()
        ray.shutdown()

    prompts = [t.prompt_token_ids for t in workload]
    ideal = ideal_cached_tokens(prompts, args.block_size)
    lens = [len(p) for p in prompts]
    summary = {name: summarize(results, ideal, lens) for name, results in runs.items()}
    ours, base = summary["prefix_affinity"], summary["default"]
    ratios = {
        "hit_rate_vs_ideal": ours["prefix_cache_hit_rate"] / ours["ideal_hit_rate"],
        "default_hit_rate_vs_ideal": base["prefix_cache_hit_rate"] / base["ideal_hit_rate"],
        "hit_rate_vs_default": ours["prefix_cache_hit_rate"] / max(base["prefix_cache_hit_rate"], 1e-9),
        "ttft_p50_speedup": base["ttft_p50_s"] / ours["ttft_p50_s"],
        "ttft_p90_speedup": base["ttft_p90_s"] / ours["ttft_p90_s"],
        "throughput_ratio": ours["output_tokens_per_s"] / base["output_tokens_per_s"],
    }
    print(f"\n{'':24}{'prefix-affinity':>16}{'default':>12}")
    rows = (("prefix_cache_hit_rate", "{:.3f}"), ("ttft_p50_s", "{:.3f}"), ("ttft_p90_s", "{:.3f}"),
            ("output_tokens_per_s", "{:.1f}"), ("requests_per_s", "{:.2f}"), ("num_failed", "{}"))
    for key, fmt in rows:
        print(f"{key:24}{fmt.format(ours[key]):>16}{fmt.format(base[key]):>12}")
    print(f"{'ideal (one replica)':24}{ours['ideal_hit_rate']:>16.3f}")
    print("\nratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    payload = {"config": vars(args) | {"model": args.model or "random llama"}, "results": summary,
               "ratios": ratios,
               "goals": {"hit_rate_vs_ideal >= 0.9": ratios["hit_rate_vs_ideal"] >= 0.9,
                         "ttft_p50_speedup >= 1.5": ratios["ttft_p50_speedup"] >= 1.5}}
    path = write_result("routing", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
