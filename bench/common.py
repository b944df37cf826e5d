"""Helpers every benchmark shares: timing against a baseline, writing results as JSON, a port."""
from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    """A localhost TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_call(fn: Callable[[], object], *, min_time_s: float = 0.2, max_reps: int = 50,
              sync: Callable[[], None] | None = None) -> float:
    """Best seconds per call, after one warm-up call; repeats until min_time_s or max_reps.

    The best, not the median: on shared cores other processes only ever add time, so the minimum
    is the steadiest estimate of the code's own cost.
    """
    fn()
    if sync:
        sync()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - began < min_time_s):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    return min(times)


def time_interleaved(fns: dict[str, Callable[[], object]], *, min_time_s: float = 0.3,
                     max_rounds: int = 30, sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Best seconds per call of each function, timed in alternating rounds (a, b, c, a, b, c...),
    so load from other processes falls on all of them alike rather than on whichever ran then."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    began = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < 3 or time.perf_counter() - began < min_time_s * len(fns)):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if sync:
                sync()
            best[name] = min(best[name], time.perf_counter() - start)
        rounds += 1
    return best


def alternate_decode_children(module: str, env_name: str, settings: dict[str, str], argv: list[str],
                              rounds: int, label: str = "") -> tuple[dict[str, list[float]], dict]:
    """Runs `python -m module --child *argv` once per setting each round, the settings alternating,
    with env_name set to the setting's value; each child prints a last line of JSON with its
    decode_tok_s and tokens. Returns (setting -> tok/s of each round, setting -> its first
    run's tokens)."""
    runs: dict[str, list[float]] = {name: [] for name in settings}
    tokens = {}
    for _ in range(rounds):
        for name, value in settings.items():
            done = subprocess.run([sys.executable, "-m", module, "--child", *argv],
                                  env={**os.environ, env_name: value}, capture_output=True, text=True,
                                  check=True, timeout=600)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(result["decode_tok_s"])
            tokens.setdefault(name, result["tokens"])
            print(f"  {label}{name:>10}: {result['decode_tok_s']:.1f} tok/s", flush=True)
    return runs, tokens


def cpu_info() -> dict:
    """The CPU a result was measured on: model name, the native kernels' level, the flags that
    pick kernels (avx2, avx512f, avx512_bf16, ...), whether bf16 is native, cores."""
    from pagedserve.kernels import (  # stdlib only: no torch import in the benchmark's parent
        cpu_features,
    )
    return {**cpu_features.describe(), "num_cpus": os.cpu_count()}


def write_result(name: str, payload: dict) -> Path:
    """Write bench/results/<name>.json, stamped with when and where it ran (the `cpu` block)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    record = {"name": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "host": {"python": platform.python_version(), "machine": platform.machine(),
                       "processor": platform.processor()}, "cpu": cpu_info(), **payload}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def max_error(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()
