"""The driver's side of tensor parallelism: start ranks 1..N-1 (local processes for the offline
LLM; Ray actors inside a Serve replica, `deployment/rank_actors.py`), join the group as rank 0,
send each step's input, notice a rank that died, and stop them.

A rank that dies fails the next step at once (its peers' sockets close) and fails
`check_alive()`, which the replica's health check calls, so Ray Serve replaces the whole replica;
a rank that hangs fails the step at the collective timeout (state.COLLECTIVE_TIMEOUT_S).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import torch

from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.parallel.sharding import check_model_splits, check_world_size
from pagedserve.replicas.parallel.worker import StepInput

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


def threads_per_rank(config: EngineConfig) -> int:
    """Each rank's torch threads: num_threads (default: the CPUs here) shared out, at least 1."""
    total = config.num_threads or len(os.sched_getaffinity(0))
    return max(1, total // config.tensor_parallel_size)


def use_ray(config: EngineConfig) -> bool:
    if config.distributed_executor_backend != "auto":
        return config.distributed_executor_backend == "ray"
    from pagedserve.replicas.deployment.rank_actors import ray_is_running
    return ray_is_running()


class Workers:
    """Ranks 1..N-1 of one engine; `tp` is the driver's (rank 0's) group state."""

    def __init__(self, config: EngineConfig, model_dir: str, device: torch.device):
        world_size = config.tensor_parallel_size
        check_model_splits(model_dir, world_size)
        ray = use_ray(config)
        if not ray:  # under Ray the placement group has already reserved the devices
            check_world_size(world_size, device.type)
        address = parallel_state.free_address()
        threads = threads_per_rank(config)
        args = [(config.model_dump(), model_dir, rank, world_size, address, threads)
                for rank in range(1, world_size)]
        if ray:  # the Ray deployment shim's: actors in the replica's placement group
            from pagedserve.replicas.deployment.rank_actors import RayRanks
            self.ranks = RayRanks(args, device)
        else:
            self.ranks = LocalRanks(args)
        self.tp = self._join(address, world_size, device)
        # An engine dropped (or left at exit) without shutdown(): it leaves the group, so that
        # another engine in this process can make one, and its ranks end at once.
        self._finalizer = weakref.finalize(self, _release, self.ranks, self.tp.group)

    def start(self, num_blocks: int) -> None:
        """After the model is loaded everywhere: the KV cache size every rank allocates."""
        self._broadcast(num_blocks)

    def send(self, step: StepInput) -> None:
        self._broadcast(step)

    def check_alive(self) -> None:
        """RuntimeError naming the first rank that has stopped."""
        dead = self.ranks.dead_rank()
        if dead is not None:
            raise RuntimeError(f"tensor-parallel rank {dead[0]} is gone: {dead[1]}")

    def shutdown(self) -> None:
        if not self._finalizer.alive:
            return
        try:
            if self.ranks.dead_rank() is None:
                self._broadcast(None)
        except Exception:  # noqa: BLE001 - a broken group: the ranks are stopped below anyway
            logger.debug("stop message failed", exc_info=True)
        self._finalizer.detach()
        _release(self.ranks, self.tp.group, STOP_TIMEOUT_S)

    # -- internals ----------------------------------------------------------------------------
    def _broadcast(self, obj) -> None:
        import torch.distributed as dist
        dist.broadcast_object_list([obj], src=0, group=self.tp.cpu_group)

    def _join(self, address: str, world_size: int, device: torch.device):
        """Join as rank 0 while watching the workers: one that dies while starting fails this
        at once instead of at the rendezvous timeout."""
        result: dict = {}

        def join():
            try:
                result["tp"] = parallel_state.init(0, world_size, address, device)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                result["error"] = exc

        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            dead = self.ranks.dead_rank()
            if dead is not None and thread.is_alive():
                self.ranks.stop(0.0)
                raise RuntimeError(f"tensor-parallel rank {dead[0]} failed to start: {dead[1]}")
        if "error" in result:
            self.ranks.stop(0.0)
            raise result["error"]
        return result["tp"]


class LocalRanks:
    """Ranks 1..N-1 as child processes of this one (the offline LLM)."""

    def __init__(self, args: list[tuple]):
        # `python -m ...parallel.worker`, its arguments pickled on stdin: unlike
        # multiprocessing's spawn it never re-imports the caller's __main__ (a script without a
        # main guard, a notebook).
        import pickle
        import subprocess
        import sys

        from pagedserve.replicas.engine.core_process import child_environ
        env = child_environ()
        self.processes = []
        for rank_args in args:
            process = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.replicas.parallel.worker"],
                stdin=subprocess.PIPE, env=env)
            process.stdin.write(pickle.dumps(rank_args))
            process.stdin.close()
            self.processes.append(process)

    def dead_rank(self) -> tuple[int, str] | None:
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return rank, f"its process exited with code {process.returncode}"
        return None

    def stop(self, wait_s: float) -> None:
        """Wait up to wait_s for the ranks to leave (after the stop message), then end them."""
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - still running: end it
                process.kill()
                process.wait(1.0)


def _release(ranks, group, wait_s: float = 0.0) -> None:
    """Leave the driver's group, then stop the ranks; takes no Workers, so that the finalizer
    holding it does not keep the Workers alive."""
    parallel_state.destroy(group)
    ranks.stop(wait_s)
