"""bench.cpu_level: `--cpu-level` caps pagedserve, torch and oneDNN, and vLLM's hardware probes."""
from __future__ import annotations

import os
import subprocess
import sys

from bench import cpu_level
from pagedserve.kernels.cpu_features import OVERRIDE_ENV


def test_apply_caps_every_library_at_the_level(monkeypatch):
    # A copy of the environment, put back after the test: the caps must not reach later tests.
    environ = {k: v for k, v in os.environ.items()
               if k not in (OVERRIDE_ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    monkeypatch.setattr(os, "environ", environ)
    cpu_level.apply(None)
    assert OVERRIDE_ENV not in os.environ
    cpu_level.apply("avx2")
    assert (os.environ[OVERRIDE_ENV], os.environ["ATEN_CPU_CAPABILITY"], os.environ["ONEDNN_MAX_CPU_ISA"]) \
        == ("avx2", "avx2", "AVX2")


def test_peer_processes_get_the_probes_first_on_their_path_only_when_capped():
    assert cpu_level.peer_environ({"PYTHONPATH": "/x"}) == {"PYTHONPATH": "/x"}
    env = cpu_level.peer_environ({OVERRIDE_ENV: "avx512", "PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(cpu_level.SITE_DIR), "/x"]


def probes(level: str) -> list[str]:
    code = ("import torch.cpu as c; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), "
            "c._is_amx_tile_supported())")
    env = cpu_level.peer_environ({**os.environ, OVERRIDE_ENV: level})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_torch_probes_answer_as_the_capped_cpu_would():
    assert probes("avx2") == ["False", "False", "False"]
    # At avx512, AVX-512 itself is the hardware's answer; what it adds beyond is hidden.
    assert probes("avx512")[1:] == ["False", "False"]
