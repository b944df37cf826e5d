"""Which CPUs an engine core's threads run on, and which the serving processes keep to.

Unbound, an engine core shares its CPUs with the processes that carry its tokens (the ingress,
the replica's shim, the client): the kernel wakes them on the core's CPU, and the core, runnable,
waits. Bound, with the serving processes kept off its CPUs, a core serves closer to its offline
speed; binding the core but letting the serving processes onto its CPUs, as vLLM-CPU binds its
engine (VLLM_CPU_OMP_THREADS_BIND), gains little (bench/serving_overhead.py measures served
against offline). The cost: serving processes that need more than the CPUs left to them (short
requests on few cores) wait longer (README, Benchmarks).

`EngineConfig.cpu_bind`: "auto" claims as many CPUs as the core has torch threads among those no
other engine core on this node holds, highest-numbered first (CPU 0 takes most of the system's
interrupts); where too few are free it binds nothing. A list ("0-3,8") binds those CPUs; "off",
nothing. Claims live in one small file per node, locked while it is read and written, each under
its holder's pid and start time, so that the CPUs of a core that died come free. Serving
processes move to the CPUs no core holds (`keep_off_engine_cpus`), where any are left.

Only the standard library: the ingress imports this too.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

# One file per node: /dev/shm is per machine (per pod under Kubernetes) and empty after a reboot.
CLAIMS_PATH = Path(os.environ.get("PAGEDSERVE_CPU_CLAIMS") or Path(
    "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / "pagedserve-cpus.json")

SUPPORTED = hasattr(os, "sched_setaffinity")  # Linux
# This process's CPUs before it moved off any engine core's: where it may go back to.
_ORIGINAL: frozenset[int] = frozenset(os.sched_getaffinity(0)) if SUPPORTED else frozenset()


def parse_cpus(spec: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8] (Linux's cpu-list format, as taskset and vLLM take it)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{spec!r} is not a CPU list such as '0-3,8'")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"{part.strip()!r}: a CPU range goes from low to high")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def check_spec(spec: str) -> str:
    """cpu_bind as EngineConfig takes it: "auto", "off" or a CPU list; ValueError otherwise."""
    if spec not in ("auto", "off"):
        parse_cpus(spec)
    return spec


def claim(spec: str, num_threads: int) -> list[int]:
    """Claim CPUs for this process's engine (see the module's docstring); [] where none."""
    if spec == "off" or not SUPPORTED:
        return []
    allowed = set(os.sched_getaffinity(0))
    with _claims() as claims:  # OSError (a file of another user's): the caller's to report
        held = {cpu for pid, claim in claims.items() if pid != str(os.getpid())
                for cpu in claim["cpus"]}
        if spec == "auto":
            free = sorted(allowed - held)
            if len(free) < num_threads:
                logger.info("engine core not bound to CPUs: %d free of %d, %d threads",
                            len(free), len(allowed), num_threads)
                return []
            cpus = free[len(free) - num_threads:]
        else:
            cpus = parse_cpus(spec)
            if not set(cpus) <= allowed:
                raise ValueError(f"cpu_bind {spec!r}: this process may run on CPUs "
                                 f"{_format(allowed)} only")
        claims[str(os.getpid())] = {"cpus": cpus, "start": _start_time(os.getpid())}
    return cpus


def release() -> None:
    """Give this process's claim back (a dead holder's is dropped by the next reader anyway)."""
    if SUPPORTED:
        with _claims() as claims:
            claims.pop(str(os.getpid()), None)


def bind(cpus: list[int]) -> None:
    """Run every thread of this process (and every thread it starts later) on `cpus`."""
    _set_affinity(set(cpus))


def engine_cpus() -> set[int]:
    """The CPUs engine cores on this node hold."""
    if not SUPPORTED:
        return set()
    with _claims() as claims:
        return {cpu for claim in claims.values() for cpu in claim["cpus"]}


def keep_off_engine_cpus() -> set[int] | None:
    """Move this process to the CPUs it started with that no engine core holds; to all of them
    where every one is held (or none is). What it runs on now."""
    if not SUPPORTED:
        return None
    target = set(_ORIGINAL) - engine_cpus() or set(_ORIGINAL)
    if target != set(os.sched_getaffinity(0)):
        _set_affinity(target)
        logger.debug("serving process %d moved to CPUs %s", os.getpid(), _format(target))
    return set(os.sched_getaffinity(0))


def restore() -> None:
    """Back to the CPUs this process started with."""
    if SUPPORTED:
        _set_affinity(set(_ORIGINAL))


def _set_affinity(cpus: set[int]) -> None:
    # os.sched_setaffinity(0) moves the calling thread only; a process's threads are its tasks.
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)


@contextlib.contextmanager
def _claims() -> Iterator[dict]:
    """The node's claims, locked; live holders only; written back as the block leaves, where
    they changed (a holder came, went or died)."""
    CLAIMS_PATH.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(CLAIMS_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    with os.fdopen(fd, "r+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            stored = json.loads(file.read() or "{}")
        except ValueError:  # torn by a writer that died mid-write: start over
            stored = None
        claims = {pid: claim for pid, claim in (stored or {}).items()
                  if _start_time(int(pid)) == claim.get("start")}
        yield claims
        if claims != stored:  # readers leave an unchanged file alone
            file.seek(0)
            file.truncate()
            file.write(json.dumps(claims))


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid, who it is (pids are
    reused); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _format(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))
