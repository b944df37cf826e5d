"""`serve run serve_app:app ...` as a user runs it: start-up, first 200, SIGTERM; bad arguments fail
fast; serve_config.yaml is a valid Serve config whose args build the app."""
from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.serve.conftest import REPO

SERVE = str(Path(sys.executable).with_name("serve"))
PORT = 8000  # `serve run <import path>` listens on Ray Serve's default port unless `port=` moves it


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def serve_run(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    # `--address local`: a fresh cluster of its own, never the test session's.
    return subprocess.Popen([SERVE, "run", "--address", "local", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise AssertionError(f"serve run exited early:\n{proc.stdout.read()[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"no 200 from {url} within {timeout_s}s")


# Ray's driver answers SIGTERM by stopping its cluster, then exits with 15 or aborts (SIGABRT).
STOPPED_CODES = (0, signal.SIGTERM, -signal.SIGTERM, 128 + signal.SIGTERM, -signal.SIGABRT)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def smoke(base: str, model: str | None = None) -> str:
    """List models, one chat completion, one completion."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    model = model or client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    completion = client.completions.create(model=model, prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens >= 1
    return chat.choices[0].message.content


def test_serve_run_import_path_with_overrides(tiny_model_dir):
    from bench.common import free_port

    port = free_port()  # the ingress serves `port` itself (pagedserve.serve_app.app.start_serve_for_serve_run)
    proc = serve_run(["serve_app:app", f"model={tiny_model_dir}", "served_model_name=tiny-cli",
                      "num_kv_blocks=128", "max_num_seqs=8", "num_replicas=1", f"port={port}"])
    try:
        startup_s = wait_ready(proc, f"http://127.0.0.1:{port}/v1/models", 180)
        print(f"serve run: first 200 after {startup_s:.1f}s")
        smoke(f"http://127.0.0.1:{port}", "tiny-cli")
        # Ray Serve's proxy would list its routes here: the port is the ingress's own server.
        assert httpx.get(f"http://127.0.0.1:{port}/-/routes").status_code == 404
    finally:
        code = stop(proc)
    assert code in STOPPED_CODES
    assert wait_for_port_closed(port, 30)
    deadline = time.monotonic() + 30
    while not group_gone(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert group_gone(proc.pid), "Ray processes outlived serve run"


def wait_for_port_closed(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_free(port):
            return True
        time.sleep(0.25)
    return False


def test_serve_run_rejects_a_bad_argument_fast():
    start = time.monotonic()
    result = subprocess.run([SERVE, "run", "serve_app:app", "max_num_seqs=zero", "colour=blue"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "colour" in output and "unknown setting" in output
    assert time.monotonic() - start < 60


def test_serve_config_yaml_is_valid_and_builds():
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "serve_config.yaml").read_text()))
    (application,) = config.applications
    assert application.name == "pagedserve" and application.route_prefix == "/"
    module, _, name = application.import_path.partition(":")
    builder = getattr(importlib.import_module(module), name)  # an app builder: it takes the args
    assert isinstance(builder(application.args), Application)


@pytest.mark.slow
@pytest.mark.skipif(not port_free(PORT), reason=f"port {PORT} is in use")
def test_readme_serve_command_answers_the_smoke_script():
    """The README's command on the embedded default model (loads SmolLM2-135M)."""
    proc = serve_run(["serve_app:app"])
    try:
        startup_s = wait_ready(proc, f"http://127.0.0.1:{PORT}/v1/models", 600)
        print(f"serve run (default model): first 200 after {startup_s:.1f}s")
        answer = smoke(f"http://127.0.0.1:{PORT}")
    finally:
        stop(proc)
    assert "Paris" in answer
