"""Concurrency, client disconnects, Ray handles from another driver, and metrics."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import httpx

from pagedserve import SamplingParams
from tests.serve.conftest import (
    API_KEY, MODEL_NAME, REPO, generated_tokens, replica_stats, wait_for, wait_until_idle,
)

WORDS = "the quick brown fox jumps over lazy dog paged attention blocks cache prefix".split()


def test_32_concurrent_streams_over_2_replicas(app, offline_llm):
    from openai import AsyncOpenAI

    prompts = [" ".join(WORDS[i % 7:i % 7 + 3 + i % 5]) + f" {i}" for i in range(32)]
    expected = offline_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16),
                                    use_tqdm=False)

    async def one(client, prompt):
        text, usage = "", None
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage

    async def run():
        client = AsyncOpenAI(base_url=f"{app.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    before = {rid: s["num_steps"] for rid, s in replica_stats(app.name, 2).items()}
    results = asyncio.run(run())
    for (text, usage), want in zip(results, expected):
        assert text == want.outputs[0].text
        assert usage.completion_tokens == len(want.outputs[0].token_ids)
    after = replica_stats(app.name, 2)
    assert all(after[rid]["num_steps"] > before[rid] for rid in before), "both replicas served"


def test_client_disconnect_aborts_and_frees_blocks(app):
    generated_before = generated_tokens(app.name, 2)
    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=app.base_url, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: {") for line in received)
        # leaving the block closes the connection mid-stream

    generated_after = wait_until_idle(app.name, 2)
    assert generated_after - generated_before < 500, "the request ran to the end: it was not aborted"


DRIVER = textwrap.dedent("""
    import asyncio, json, sys
    import ray
    from ray import serve

    ray.init(address=sys.argv[1], namespace="serve", log_to_driver=False)
    handle = serve.get_app_handle("pagedserve")
    request = {"model": "%s", "max_tokens": 10, "temperature": 0,
               "messages": [{"role": "user", "content": "what is the capital of france"}]}

    async def main():
        whole = await handle.chat.remote(request)
        text, roles = "", []
        async for chunk in handle.options(stream=True).chat.remote({**request, "stream": True}):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                roles.append(choice.delta.role)
        print(json.dumps({"whole": whole.choices[0].message.content, "streamed": text,
                          "first_role": roles[0], "type": type(whole).__name__}))

    asyncio.run(main())
""" % MODEL_NAME)


def test_separate_driver_streams_through_the_app_handle(app, client):
    result = subprocess.run([sys.executable, "-c", DRIVER, app.cluster.gcs_address], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    reply = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "what is the capital of france"}])
    http_text = reply.choices[0].message.content
    assert out == {"whole": http_text, "streamed": http_text, "first_role": "assistant",
                   "type": "ChatCompletionResponse"}


def test_metrics_endpoint_exports_our_metrics(http):
    http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3})

    def exported():
        text = http.get("/metrics").text
        return all(name in text for name in ("ray_pagedserve_requests", "ray_pagedserve_kv_cache_usage",
                                             "ray_pagedserve_time_to_first_token_seconds",
                                             "ray_pagedserve_compute_utilization",
                                             "ray_pagedserve_kv_working_set")) and text

    text = wait_for(exported, 20, 0.5, "our metrics on /metrics")
    assert all(line.startswith(("# ", "ray_pagedserve_")) for line in text.strip().splitlines())
