"""`pagedserve` as a user runs it: --help, a refused flag, and one real server (tiny model)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.common import free_port
from pagedserve import flags
from pagedserve.catalog import catalog
from tests.serve.conftest import REPO

PAGEDSERVE = str(Path(sys.executable).with_name("pagedserve"))


def env() -> dict[str, str]:
    environ = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0"}
    environ.pop("RAY_ADDRESS", None)
    return environ


def test_help_lists_every_flag_with_its_default():
    result = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--help"], cwd=REPO,
                            env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for setting in catalog():
        for name in setting.flag_names:
            assert name in result.stdout, name
    for names in flags.PINNED_VLLM_FLAGS:
        assert names[0] in result.stdout
    text = " ".join(result.stdout.split())
    assert "--max-num-seqs N Most sequences one replica runs in a batch (default: 64)" in text


def test_console_script_refuses_a_vllm_flag_in_one_line():
    result = subprocess.run([PAGEDSERVE, "serve", "--trust-remote-code"], cwd=REPO, env=env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--trust-remote-code" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_serve_answers_the_openai_sdk_with_the_key_and_401_without(tiny_model_dir):
    from openai import AuthenticationError, OpenAI

    port = free_port()
    proc = subprocess.Popen(
        [PAGEDSERVE, "serve", tiny_model_dir, "--served-model-name", "tiny", "--port", str(port),
         "--max-num-seqs", "8", "--max-model-len", "256", "--num-kv-blocks", "64",
         "--api-key", "k", "--graceful-shutdown-timeout-s", "1"],
        cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "no 200 from /health"
            time.sleep(0.25)
        client = OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=60)
        (card,) = client.models.list().data
        assert card.id == "tiny" and card.max_model_len == 256  # engine flags reached the replica
        reply = client.completions.create(model="tiny", prompt="hello", max_tokens=4,
                                          temperature=0)
        assert reply.usage.completion_tokens >= 1
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{base}/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    output = proc.stdout.read()
    assert code == 0, output[-4000:]
    assert "pagedserve: shutting down" in output
