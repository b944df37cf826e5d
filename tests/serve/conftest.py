"""One local Ray cluster per test session, the main app deployed once, tiny models built here.

The main app ("pagedserve", 2 engine replicas, API keys on) serves most tests over its ingress's
own HTTP server (direct_http, as `serve run serve_app:app` serves); tests that break replicas or
need tiny queue limits deploy their own app next to it under another route prefix, reached
through Ray Serve's proxy (`cluster.base_url`).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from bench.common import free_port

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-0123456789"
MODEL_NAME = "tiny-llama"
# Sized for tests: a small KV pool (the default would allocate a GiB per replica).
ENGINE_ARGS = dict(served_model_name=MODEL_NAME, max_model_len=512, num_kv_blocks=256,
                   max_num_seqs=32, block_size=16)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.tiny_models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama"))


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory) -> str:
    """A tiny reasoning model: `<think>` and `</think>` one token each, a Qwen3-style template."""
    from tests.tiny_models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("thinking") / "llama", "llama", seed=7,
                                thinking=True))


@pytest.fixture(scope="session")
def fault_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault") / "trigger"


@pytest.fixture(scope="session")
def cluster(fault_file):
    import ray
    from ray import serve

    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PAGEDSERVE_FAULT_FILE": str(fault_file)}
    # A cluster of its own, whatever else runs on the machine (`ray start` elsewhere).
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env},
             _system_config={"metrics_report_interval_ms": 1000})
    for attempt in range(3):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            break
        except ray.exceptions.RayError:  # the port was taken before the proxy bound it
            serve.shutdown()
            if attempt == 2:
                raise
    yield SimpleNamespace(port=port, base_url=f"http://127.0.0.1:{port}",
                          gcs_address=ray.get_runtime_context().gcs_address)
    serve.shutdown()
    ray.shutdown()


def deploy(settings: dict, name: str, route_prefix: str):
    from ray import serve

    from pagedserve.serve_app import build_app
    serve.run(build_app(settings), name=name, route_prefix=route_prefix)


@pytest.fixture(scope="session")
def app(cluster, tiny_model_dir):
    """The main application: 2 replicas of the tiny model, keys required, HTTP and gRPC from the
    ingress."""
    port, grpc_port = free_port(), free_port()
    deploy(dict(model=tiny_model_dir, num_replicas=2, replica_num_cpus=0.5, api_keys=API_KEY,
                health_check_period_s=1.0, direct_http=True, port=port, grpc_port=grpc_port,
                **ENGINE_ARGS),
           "pagedserve", "/")
    return SimpleNamespace(base_url=f"http://127.0.0.1:{port}", name="pagedserve", cluster=cluster,
                           grpc_port=grpc_port)


@pytest.fixture(scope="session")
def http(app):
    with httpx.Client(base_url=app.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture(scope="session")
def client(app):
    from openai import OpenAI
    return OpenAI(base_url=f"{app.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def offline_llm(tiny_model_dir):
    """The offline API on the same model and engine settings: the reference for greedy text."""
    from pagedserve import LLM
    return LLM(tiny_model_dir, num_threads=1, **ENGINE_ARGS)


def replica_stats(app_name: str, num_replicas: int, timeout_s: float = 20.0) -> dict[str, dict]:
    """stats() of every replica of an app (handle calls land on random replicas: ask until all
    have answered)."""
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", app_name)
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < num_replicas:
        stats = handle.stats.remote().result()
        seen[stats["replica_id"]] = stats
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(seen)} of {num_replicas} replicas answered")
    return seen


def generated_tokens(app_name: str, num_replicas: int) -> int:
    """Tokens the app's engines have generated so far, all replicas together."""
    return sum(s["num_generation_tokens"] for s in replica_stats(app_name, num_replicas).values())


def wait_until_idle(app_name: str, num_replicas: int, timeout_s: float = 10.0) -> int:
    """Wait until no engine has a request and every KV block is free (an aborted request has
    let go of its blocks); then the tokens generated so far."""
    def idle():
        stats = replica_stats(app_name, num_replicas)
        free = all(s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0
                   and s["num_waiting"] == 0 for s in stats.values())
        return free and (sum(s["num_generation_tokens"] for s in stats.values()),)

    return wait_for(idle, timeout_s, 0.2, "every KV block to be free")[0]


def core_digests(app_name: str, timeout_s: float = 20.0) -> dict[str, dict]:
    """Each engine core's routing digest, full snapshot included, as an ingress receives it on
    joining: connect to every core the app's directory lists."""
    import asyncio

    from ray import serve

    from pagedserve.replicas.engine import protocol

    _, entries, _ = serve.get_deployment_handle("CoreDirectory", app_name).watch.remote(-1).result()

    async def digest(host: str, port: int, token: str) -> dict:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(protocol.frame(protocol.Hello(protocol.PROTOCOL_VERSION, token, "test")))
        frames = protocol.client_reader()
        try:
            while True:
                for message in frames.feed(await reader.read(1 << 20)):
                    if message.digest is not None:
                        return message.digest
        finally:
            writer.close()

    async def all_digests() -> dict[str, dict]:
        found = await asyncio.gather(*(asyncio.wait_for(digest(*address), timeout_s)
                                       for address in entries.values()))
        return dict(zip(entries, found))

    return asyncio.run(all_digests())
