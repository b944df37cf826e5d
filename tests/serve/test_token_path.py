"""The one token path over real Ray Serve and HTTP: coalesced streams, disconnects, stop strings
met in the ingress, and a killed replica.

The app here paces as hard as it can (a stream's events at most max_stream_delay_s apart: 200 ms
here rather than the default 20, so that steps slowed by a busy machine still leave several tokens
to each event); its engine is slowed so that a replica can be killed mid-stream. It serves HTTP
from its ingress (direct_http), the path `serve run serve_app:app` takes.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.common import free_port
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, deploy, replica_stats, wait_for

APP = "tokenpath"
PREFIX = "/tokenpath"


@pytest.fixture(scope="module")
def coalesced(cluster, tiny_model_dir):
    port = free_port()
    deploy(dict(model=tiny_model_dir, num_replicas=2, replica_num_cpus=0.5,
                max_stream_events_per_s=1, max_stream_delay_s=0.2, health_check_period_s=1.0,
                direct_http=True, port=port, engine_class="tests.serve.slow_engine:SlowEngine",
                **ENGINE_ARGS), APP, PREFIX)
    yield f"http://127.0.0.1:{port}"
    from ray import serve
    serve.delete(APP)


def events(response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def all_free() -> bool:
    return all(s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_requests"] == 0
               for s in replica_stats(APP, 2).values())


def test_coalesced_stream_joins_to_the_non_streamed_text(coalesced):
    body = {"model": MODEL_NAME, "prompt": "the quick brown fox jumps over the lazy dog " * 4,
            "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=coalesced, timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(e) for e in events(r) if e != "[DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == whole
    assert len([t for t in texts if t]) < 30, "60 tokens in about as many events: not coalesced"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    stats = replica_stats(APP, 2).values()
    assert sum(s["num_clients"] for s in stats) == 2  # one connection from the ingress to each


def test_coalesced_n2_logprobs_chunks_stay_well_formed(coalesced):
    body = {"model": MODEL_NAME, "prompt": "paged attention", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0, "n": 2, "logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=coalesced, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            chunks = [json.loads(e) for e in events(r) if e != "[DONE]"]
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        whole = http.post("/v1/completions", json=plain).json()
    tokens = {0: [], 1: []}
    tops = {0: [], 1: []}
    text = {0: "", 1: ""}
    multi = 0
    for chunk in chunks:
        for choice in chunk["choices"]:
            lp = choice["logprobs"]
            if lp is None:
                assert choice["text"] == "" and choice["finish_reason"] == "length"
                continue
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
                == len(lp["text_offset"])
            tops[choice["index"]] += lp["top_logprobs"]
            assert lp["text_offset"][0] == len(text[choice["index"]])
            multi += len(lp["tokens"]) > 1
            tokens[choice["index"]] += lp["tokens"]
            text[choice["index"]] += choice["text"]
    assert multi, "no chunk carried several tokens"
    assert len(tokens[0]) == len(tokens[1]) == 40
    assert chunks[-1]["usage"]["completion_tokens"] == 80
    assert [text[0], text[1]] == [c["text"] for c in whole["choices"]]
    for i, c in enumerate(whole["choices"]):
        assert tokens[i] == c["logprobs"]["tokens"] and tops[i] == c["logprobs"]["top_logprobs"]


def test_a_stop_string_met_across_events_ends_the_stream_and_frees_the_blocks(coalesced,
                                                                             offline_llm):
    from pagedserve import SamplingParams

    prompt = "stop strings in the ingress"
    free = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60,
                                                       ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 4]  # met in the middle of a coalesced stream
    expected = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=400,
                                                           ignore_eos=True, stop=[stop]),
                                    use_tqdm=False)[0].outputs[0]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stop": [stop], "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=coalesced, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(e) for e in events(r) if e != "[DONE]"]
        whole = http.post("/v1/completions", json={k: v for k, v in body.items()
                                                   if k != "stream_options"}).json()
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    finish = [c["choices"][0] for c in chunks if c["choices"]][-1]
    assert streamed == whole["choices"][0]["text"] == expected.text
    assert (finish["finish_reason"], finish["stop_reason"]) == ("stop", stop)
    assert chunks[-1]["usage"]["completion_tokens"] == len(expected.token_ids)
    assert whole["usage"]["completion_tokens"] == len(expected.token_ids)
    # The core was told to stop: 400 slowed steps would take far longer than this wait.
    wait_for(all_free, 5, 0.1, "the core to abort the stopped request")


def test_disconnect_mid_coalesced_stream_frees_the_blocks(coalesced):
    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=coalesced, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(4))
    wait_for(all_free, 15, 0.2, "every KV block to be free")


# Each stream goes to its prompt's cold-prefix home, and the homes of 8 streams were once all one
# replica (leaving nothing to survive the kill). With 16, the load guard (cold_home_max_excess_load,
# 8) sends some to the other replica whatever the homes.
STREAMS = 16


def test_a_killed_replica_fails_exactly_its_own_streams_and_no_request_after(coalesced):
    import ray

    body = {"model": MODEL_NAME, "max_tokens": 480, "ignore_eos": True, "temperature": 0,
            "stream": True}

    async def one(http, i, started, max_tokens=480):
        outcome = {"tokens": 0, "error": None, "done": False, "finish": None}
        async with http.stream("POST", "/v1/completions", json={
                **body, "prompt": f"request number {i} of {STREAMS}",
                "max_tokens": max_tokens}) as r:
            if r.status_code != 200:
                outcome["error"] = {"status": r.status_code, "body": (await r.aread()).decode()}
                return outcome
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    outcome["done"] = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    outcome["error"] = event["error"]
                    continue
                started.add(i)
                outcome["finish"] = event["choices"][0]["finish_reason"] or outcome["finish"]
        return outcome

    async def run():
        started: set[int] = set()
        async with httpx.AsyncClient(base_url=coalesced, timeout=120) as http:
            tasks = [asyncio.create_task(one(http, i, started)) for i in range(STREAMS)]
            while len(started) < STREAMS:
                await asyncio.sleep(0.05)
            # A replica's stats are its core's last report: read until they count every stream
            # (none can have ended: 480 slowed steps take longer).
            for _ in range(40):
                stats = await asyncio.to_thread(replica_stats, APP, 2)
                if sum(s["num_requests"] for s in stats.values()) >= STREAMS:
                    break
                await asyncio.sleep(0.05)
            victim, held = max(((rid, s["num_requests"]) for rid, s in stats.items()),
                               key=lambda kv: kv[1])
            name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if victim in a["name"] and "EngineReplica" in a["name"])
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            # Requests right after the kill, while Ray Serve has not replaced the replica yet:
            # the healthy one serves them all (one sent to the dead core goes again elsewhere).
            after = await asyncio.gather(*(one(http, 100 + i, set(), max_tokens=4)
                                           for i in range(16)))
            return held, stats, await asyncio.gather(*tasks), after

    held, stats, outcomes, after = asyncio.run(run())
    failed = [o for o in outcomes if o["error"] is not None]
    assert 0 < held < STREAMS and len(failed) == held, (held, stats, outcomes)
    for o in failed:
        assert o["done"] and o["error"]["code"] == "service_unavailable", o
    for o in outcomes:
        if o["error"] is None:
            assert o["done"] and o["finish"] == "length", o
    assert all(o["error"] is None and o["done"] for o in after), after
