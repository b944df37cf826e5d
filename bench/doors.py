"""CPU per streamed token through each door: chat completions against the Responses API and
Anthropic's Messages API, on one served app.

The doors share the chat route's pipeline and differ only in how they shape the stream, so the
same chat request (greedy, `ignore_eos`, a fixed output length) is sent through each, with
`--concurrency` streams open at once; rounds alternate the doors' order, and every round has new
prompts. For each door: the CPU seconds of every serving process (the ingress, the engine core,
Ray's) and of the ingress alone, read from /proc before and after, per streamed output token.
Prints each door's medians and its ratio to chat's (the Responses goal: within 1.1x of chat's
CPU per token); writes JSON.

    python -m bench.doors [--model DIR|tiny] [--rounds 3] [--num-requests 32] [--concurrency 16]
                          [--output-len 64] [--doors chat,responses,messages]

`--model tiny` (the default) is a 3-layer random Llama whose forward costs almost nothing, so the
doors' own costs are most of what is measured.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time

from bench.common import cpu_info, free_port, write_result
from bench.serving_overhead import build_tiny, serving_cpu_seconds

INGRESS = "ray::ServeReplica:pagedserve:Ingress"
WORDS = "the quick brown fox jumps over a lazy dog paged cache prefix serving tokens".split()


def body(door: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": prompt}]
    if door == "chat":
        return "/v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if door == "responses":
        return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens,
                                 "temperature": 0, "ignore_eos": True, "stream": True,
                                 "store": False}
    # Anthropic's request has no ignore_eos: an early end of text only shortens the stream.
    return "/v1/messages", {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0, "stream": True}


def output_tokens(door: str, event: dict) -> int | None:
    """The stream's output token count, from the event that carries it."""
    if door == "chat":
        return (event.get("usage") or {}).get("completion_tokens")
    if door == "responses":
        if event.get("type") == "response.completed":
            return event["response"]["usage"]["output_tokens"]
        return None
    if event.get("type") == "message_delta":
        return event["usage"]["output_tokens"]
    return None


async def stream_one(session, door: str, model: str, prompt: str, max_tokens: int) -> int:
    path, payload = body(door, model, prompt, max_tokens)
    tokens = 0
    async with session.post(path, json=payload) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            count = output_tokens(door, json.loads(line[6:]))
            tokens = count if count is not None else tokens
    return tokens


async def run_door(base_url: str, door: str, model: str, prompts: list[str], args) -> dict:
    import aiohttp

    semaphore = asyncio.Semaphore(args.concurrency)

    async def one(session, prompt):
        async with semaphore:
            return await stream_one(session, door, model, prompt, args.output_len)

    before = serving_cpu_seconds()
    start = time.perf_counter()
    async with aiohttp.ClientSession(base_url, timeout=aiohttp.ClientTimeout(total=600)) as session:
        tokens = sum(await asyncio.gather(*(one(session, p) for p in prompts)))
    seconds = time.perf_counter() - start
    after = serving_cpu_seconds()
    used = {pid: (name, cpu - before.get(pid, (name, 0.0))[1]) for pid, (name, cpu) in after.items()}
    total = sum(cpu for _, cpu in used.values())
    ingress = sum(cpu for name, cpu in used.values() if name == INGRESS)
    return {"door": door, "output_tokens": tokens, "seconds": seconds,
            "cpu_us_per_token": 1e6 * total / tokens, "ingress_cpu_us_per_token": 1e6 * ingress / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="HF directory, or 'tiny'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--doors", default="chat,responses,messages")
    args = parser.parse_args()
    doors = args.doors.split(",")
    if args.model == "tiny":
        args.model = build_tiny(tempfile.mkdtemp(prefix="bench-doors-tiny-"))

    import httpx
    import ray
    from ray import serve

    from pagedserve.serve_app import build_app
    from pagedserve.serve_app.app import start_serve
    from pagedserve.serve_app.config import ServeSettings

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    settings = ServeSettings.from_args({"model": args.model, "num_replicas": 1, "host": "127.0.0.1",
                                        "port": port, "direct_http": True, "num_threads": 1,
                                        "max_num_seqs": 64})
    serve.run(build_app(start_serve(settings)), name="pagedserve", route_prefix="/")
    base_url = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{base_url}/v1/models", timeout=60).json()["data"][0]["id"]
    rounds: list[dict] = []
    try:
        warm = [" ".join(WORDS[:4])] * 4
        for door in doors:
            asyncio.run(run_door(base_url, door, model, warm, args))
        for round_ in range(args.rounds):
            rng = random.Random(round_)
            prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 48)))
                       for _ in range(args.num_requests)]
            order = doors if round_ % 2 == 0 else doors[::-1]
            for door in order:
                result = asyncio.run(run_door(base_url, door, model, prompts, args))
                result["round"] = round_
                rounds.append(result)
                print(f"round {round_} {door:9s} {result['output_tokens']:5d} tokens  "
                      f"{result['cpu_us_per_token']:7.1f} us CPU/token  "
                      f"(ingress {result['ingress_cpu_us_per_token']:6.1f})", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    summary = {}
    for door in doors:
        mine = [r for r in rounds if r["door"] == door]
        summary[door] = {key: statistics.median(r[key] for r in mine)
                         for key in ("cpu_us_per_token", "ingress_cpu_us_per_token")}
    base = summary.get("chat")
    for door, figures in summary.items():
        if base is not None:
            figures["ratio_to_chat"] = figures["cpu_us_per_token"] / base["cpu_us_per_token"]
            figures["ingress_ratio_to_chat"] = (figures["ingress_cpu_us_per_token"]
                                                / base["ingress_cpu_us_per_token"])
        print(f"{door:9s} median {figures['cpu_us_per_token']:7.1f} us CPU/token "
              f"(ingress {figures['ingress_cpu_us_per_token']:6.1f})"
              + (f"  x{figures['ratio_to_chat']:.3f} of chat (ingress "
                 f"x{figures['ingress_ratio_to_chat']:.3f})" if base is not None else ""))
    path = write_result("doors", {"cpu": cpu_info(), "args": vars(args), "summary": summary,
                                  "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
