"""The cost of the serving path: 32 concurrent streams over HTTP vs offline `LLM.generate`.

The same seeded requests (token-id prompts, greedy, `ignore_eos`, fixed output lengths) run
through `LLM.generate` in a subprocess, and as 32 concurrent streaming `/v1/completions` calls to
the Ray Serve app (ingress -> engine replicas; `--http proxy`: Ray Serve's proxy in front) started
in this process. Rounds alternate
(offline, serving, offline, ...) so load from other processes falls on both; each round has new
prompts (no prefix-cache hits from an earlier round); the best round of each counts. Prints output tokens/s for both and the ratio (goal >= 0.9); writes JSON.

    python -m bench.serving_overhead [--model DIR|tiny] [--replicas 1] [--threads 1] [--rounds 2]

`--model tiny` builds a 3-layer, 96-wide random Llama whose forward costs almost nothing, so the
ratio and the CPU time per streamed token (all Ray processes together, read from /proc before and
after the serving round) are the serving path's own cost.

By default one replica with one torch thread is compared with the offline engine on one thread:
the same compute, so the ratio is the serving path's own cost. `--replicas 2 --offline-threads 2`
compares the best each can do on two cores; the core-seconds the serving round left idle are
printed beside it: a fixed cost per run (filling and draining the closed loop over two replicas,
~1.9 core-seconds on a 2-core Zen 4), so longer runs (`--num-requests 512`) show the steady state.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from bench.common import free_port, write_result


def workload(args, vocab_size: int, special_ids: set[int]) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    usable = [t for t in range(vocab_size) if t not in special_ids]
    return [([rng.choice(usable) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
             args.output_len) for _ in range(args.num_requests)]


def engine_args(args, threads: int) -> dict:
    return dict(num_threads=threads, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=args.kv_cache_gb)


def engine_settings(args) -> dict:
    """The --set settings that are the engine's (dtype, ...): the offline run takes them too, so
    that both sides compare the same engine."""
    from pagedserve.replicas.config import EngineConfig
    return {key: value for key, value in (item.split("=", 1) for item in args.set)
            if key in EngineConfig.model_fields}


TINY_MODEL = dict(num_layers=3, hidden_size=96, num_heads=3, num_kv_heads=1,  # head_dim 32: vLLM-CPU has no kernel for 24
                  max_position_embeddings=2048)


def build_tiny(out_dir: str) -> str:
    from tests.tiny_models import build_tiny_model
    build_tiny_model(out_dir, "llama", **TINY_MODEL)
    return out_dir


def serving_cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by every process this one started (Ray's, not the load client),
    by pid, with its title (`ray::ServeReplica:pagedserve:Ingress`, `ray::ProxyActor`, raylet,
    ...). By pid: a process retitles itself when Ray hands it an actor, and a title's earlier
    reading would then be missing, its whole life counted (idle cores read negative)."""
    import psutil

    by_pid: dict[int, tuple[str, float]] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            cmdline = child.cmdline()
            if cmdline and cmdline[0].startswith("ray::"):
                name = cmdline[0].split()[0]
            elif cmdline[1:2] == ["-m"]:  # an engine core, a tensor-parallel rank
                name = cmdline[2]
            else:
                name = child.name()
        except psutil.Error:  # exited meanwhile
            continue
        by_pid[child.pid] = (name, times.user + times.system)
    return by_pid


def offline_child(args) -> None:
    from pagedserve import LLM, SamplingParams

    llm = LLM(args.model, **{**engine_args(args, args.offline_threads), **engine_settings(args)})
    tokenizer = llm.get_tokenizer()
    requests = workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    llm.generate({"prompt_token_ids": requests[0][0][:16]}, SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
              "texts": [o.outputs[0].text for o in outputs]}
    with open(args.out, "w") as f:
        json.dump(result, f)


def run_offline(argv: list[str], seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        subprocess.run([sys.executable, "-m", "bench.serving_overhead", *argv, "--seed", str(seed),
                        "--child", "--out", tmp.name], check=True)
        return json.load(open(tmp.name))


async def stream_one(session, model: str, prompt: list[int], max_tokens: int) -> tuple[str, int, float]:
    """One streaming completion. aiohttp reads the events: the load generator shares the cores
    with the servers, and it costs half the CPU per event of httpx's line iterator (68-70 against
    143-157 us per one-token event, measured side by side on a 2-core Zen 4)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, tokens, first, times = "", 0, None, []
    start = time.perf_counter()
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:  # one line at a time; events end with a blank line
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                first = first or time.perf_counter() - start
                text += chunk["choices"][0]["text"]
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return text, tokens, first, times


async def run_serving_round(base_url: str, model: str, requests, concurrency: int) -> dict:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)

    async def gated(client, prompt, max_tokens):
        async with gate:
            return await stream_one(client, model, prompt, max_tokens)

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(base_url, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as client:
        await stream_one(client, model, requests[0][0][:16], 4)  # warm-up
        cpu_before, client_before = serving_cpu_seconds(), time.process_time()
        start = time.perf_counter()
        results = await asyncio.gather(*(gated(client, p, n) for p, n in requests))
        seconds = time.perf_counter() - start
        cpu_after, client_cpu_s = serving_cpu_seconds(), time.process_time() - client_before
        cpu_by_process: dict[str, float] = {}
        for pid, (name, used) in cpu_after.items():
            cpu_by_process[name] = (cpu_by_process.get(name, 0.0) + used
                                    - cpu_before.get(pid, (name, 0.0))[1])
        cpu_seconds = sum(cpu_by_process.values())
    ttfts = sorted(r[2] for r in results)
    # Inter-event latency as `vllm bench serve` counts it: the gaps between a stream's chunks.
    itls = sorted(b - a for r in results for a, b in zip(r[3], r[3][1:]))
    output_tokens = sum(r[1] for r in results)
    per_token = 1e6 / max(output_tokens, 1)
    # What no process used of the machine's cores: with two replicas, mostly the fill and drain of
    # the closed loop (the replica that ends first waits for the other), a fixed cost per run.
    cores = os.cpu_count() or 1
    return {"seconds": seconds, "output_tokens": output_tokens, "cpu_seconds": cpu_seconds,
            "idle_core_seconds": cores * seconds - cpu_seconds - client_cpu_s, "cores": cores,
            "cpu_us_per_token": cpu_seconds * per_token,
            # The load generator shares the machine: what it takes, the servers cannot have.
            "client_cpu_us_per_token": client_cpu_s * per_token,
            "cpu_us_per_token_by_process": {name: round(s * per_token, 1) for name, s in
                                            sorted(cpu_by_process.items(), key=lambda kv: -kv[1])
                                            if s * per_token >= 1},
            "tokens_per_event": output_tokens / max(sum(len(r[3]) for r in results), 1),
            "itl_p50_s": itls[len(itls) // 2] if itls else None,
            "texts": [r[0] for r in results], "ttft_p50_s": ttfts[len(ttfts) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="HF directory, or 'tiny' (default: the embedded model)")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--offline-threads", type=int, default=None, help="default: --threads")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32, help="streams open at once")
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--http", choices=("direct", "proxy"), default="direct",
                        help="HTTP served by the ingress replicas (the default) or Ray Serve's proxy")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a serving setting for the app (serve_app/config.py), repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.offline_threads = args.offline_threads or args.threads
    if args.model == "tiny" and not args.child:
        args.model = build_tiny(tempfile.mkdtemp(prefix="bench-serving-tiny-"))
        sys.argv = [{"tiny": args.model, "--model=tiny": f"--model={args.model}"}.get(a, a)
                    for a in sys.argv]
    if args.child:
        return offline_child(args)

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from pagedserve.replicas.engine import cpu_binding
    from pagedserve.replicas.model_files.default_model import resolve_model
    from pagedserve.serve_app import build_app
    from pagedserve.serve_app.app import start_serve
    from pagedserve.serve_app.config import ServeSettings

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    ray.init(num_cpus=max(2, args.replicas * args.threads), include_dashboard=False, log_to_driver=False)
    port = free_port()
    began = time.perf_counter()
    settings = ServeSettings.from_args({
        **dict(item.split("=", 1) for item in args.set), "model": args.model,
        "num_replicas": args.replicas, "replica_num_cpus": args.threads, "host": "127.0.0.1",
        "port": port, "direct_http": args.http == "direct", **engine_args(args, args.threads)})
    serve.run(build_app(start_serve(settings)), name="pagedserve", route_prefix="/")
    deploy_s = time.perf_counter() - began
    import httpx
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60).json()["data"][0]["id"]
    offline_rounds, serving_rounds = [], []
    base_seed = args.seed
    try:
        for round_ in range(args.rounds):
            # New prompts every round: the app's prefix cache must not serve a repeat.
            args.seed = base_seed + round_
            requests = workload(args, len(tokenizer), set(tokenizer.all_special_ids))
            offline_rounds.append(run_offline(sys.argv[1:], args.seed))
            # The load generator stands in for clients elsewhere: off the engine cores' CPUs
            # while it runs (as the serving processes are), on all of them for the offline child.
            cpu_binding.keep_off_engine_cpus()
            try:
                serving = asyncio.run(run_serving_round(f"http://127.0.0.1:{port}", model,
                                                        requests, args.concurrency))
            finally:
                cpu_binding.restore()
            serving["identical_texts"] = sum(a == b for a, b in zip(offline_rounds[-1]["texts"],
                                                                    serving["texts"]))
            serving_rounds.append(serving)
    finally:
        serve.shutdown()
        ray.shutdown()
    args.seed = base_seed

    offline = min(offline_rounds, key=lambda r: r["seconds"])
    serving = min(serving_rounds, key=lambda r: r["seconds"])
    for r in (offline, serving):
        r["tokens_per_s"] = r["output_tokens"] / r["seconds"]
    same_text = min(r["identical_texts"] for r in serving_rounds)
    ratio = serving["tokens_per_s"] / offline["tokens_per_s"]
    print(f"offline LLM.generate ({args.offline_threads} thread(s)): {offline['tokens_per_s']:8.1f} "
          f"output tok/s ({offline['output_tokens']} tokens in {offline['seconds']:.1f}s)")
    print(f"HTTP ({args.http}), {args.num_requests} requests, {args.concurrency} streams at once, {args.replicas} replica(s) x {args.threads} thread(s): "
          f"{serving['tokens_per_s']:8.1f} output tok/s ({serving['output_tokens']} tokens in "
          f"{serving['seconds']:.1f}s, TTFT p50 {serving['ttft_p50_s'] * 1e3:.1f}ms, "
          f"ITL p50 {1e3 * (serving['itl_p50_s'] or 0):.1f}ms, "
          f"{serving['cpu_us_per_token']:.0f} us of serving CPU per token "
          f"(+{serving['client_cpu_us_per_token']:.0f} us in the load generator), "
          f"{serving['idle_core_seconds']:.1f} of {serving['cores']} cores x "
          f"{serving['seconds']:.1f}s left idle, "
          f"{serving['tokens_per_event']:.1f} tokens per event)")
    print("  serving CPU per token, by process:", ", ".join(
        f"{name} {us:.0f} us" for name, us in serving["cpu_us_per_token_by_process"].items()))
    print(f"serving / offline throughput: {ratio:.3f}  (greedy texts identical in every round: "
          f"{same_text}/{args.num_requests}; app deployed in {deploy_s:.1f}s)")
    strip = lambda r: {k: v for k, v in r.items() if k != "texts"}  # noqa: E731
    summary = {"config": vars(args), "ratio_serving_vs_offline": ratio, "deploy_seconds": deploy_s,
               "identical_texts": same_text, "offline": strip(offline), "serving": strip(serving),
               "rounds": {"offline_s": [r["seconds"] for r in offline_rounds],
                          "serving_s": [r["seconds"] for r in serving_rounds]}}
    print("wrote", write_result(f"serving_overhead_{args.replicas}x{args.threads}", summary))


if __name__ == "__main__":
    main()
