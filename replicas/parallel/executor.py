"""The driver's side of tensor parallelism: start ranks 1..N-1 (local processes for the offline
LLM, Ray actors inside a Ray worker such as a Serve replica), join the group as rank 0, send each
step's input, notice a rank that died, and stop them.

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
from pathlib import Path

import torch

from replicas.config import EngineConfig
from replicas.parallel import state as parallel_state
from replicas.parallel.sharding import check_tensor_parallel, check_world_size
from replicas.parallel.worker import StepInput, TensorParallelWorker

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
RANK_ACTOR_PREFIX = "pagedserve-tp-rank"


def threads_per_rank(config: EngineConfig) -> int:
    """Each rank's torch threads: num_threads (default: the CPUs here) shared out, at least 1."""
    total = config.num_threads or len(os.sched_getaffinity(0))
    return max(1, total // config.tensor_parallel_size)


def use_ray(config: EngineConfig) -> bool:
    if config.distributed_executor_backend != "auto":
        return config.distributed_executor_backend == "ray"
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


class Workers:
    """Ranks 1..N-1 of one engine; `tp` is the driver's (rank 0's) group state."""

    def __init__(self, config: EngineConfig, model_dir: str, device: torch.device):
        from replicas.model_loader import load_config
        from replicas.models import get_model_class
        from replicas.quant import quantization_of

        world_size = config.tensor_parallel_size
        hf_config = load_config(model_dir)
        check_tensor_parallel(hf_config, world_size, get_model_class(hf_config),
                              quantized=quantization_of(model_dir) is not None)
        self.ray = use_ray(config)
        if not self.ray:  # under Ray the placement group has already reserved the devices
            check_world_size(world_size, device.type)
        address = parallel_state.free_address()
        threads = threads_per_rank(config)
        args = [(config.model_dump(), model_dir, rank, world_size, address, threads)
                for rank in range(1, world_size)]
        self._handles = self._start_ray(args, device) if self.ray else self._start_local(args)
        self.tp = self._join(address, world_size, device)
        # An engine dropped (or left at exit) without shutdown(): it leaves the group, so that
        # another engine in this process can make one, and its ranks end at once.
        self._finalizer = weakref.finalize(self, _release, self.ray, self._handles, self.tp.group)

    def start(self, num_blocks: int) -> None:
        """After the model is loaded everywhere: the KV cache size every rank allocates."""
        self._broadcast(num_blocks)

    def send(self, step: StepInput) -> None:
        self._broadcast(step)

    def check_alive(self) -> None:
        """RuntimeError naming the first rank that has stopped."""
        dead = self._dead_rank()
        if dead is not None:
            raise RuntimeError(f"tensor-parallel rank {dead[0]} is gone: {dead[1]}")

    def shutdown(self) -> None:
        if not self._finalizer.alive:
            return
        try:
            if self._dead_rank() is None:
                self._broadcast(None)
        except Exception:  # noqa: BLE001 - a broken group: the ranks are stopped below anyway
            logger.debug("stop message failed", exc_info=True)
        self._finalizer.detach()
        _release(self.ray, self._handles, self.tp.group, STOP_TIMEOUT_S)

    # -- internals ----------------------------------------------------------------------------
    def _broadcast(self, obj) -> None:
        import torch.distributed as dist
        dist.broadcast_object_list([obj], src=0, group=self.tp.cpu_group)

    def _start_local(self, args):
        # `python -m replicas.parallel.worker`, its arguments pickled on stdin: unlike
        # multiprocessing's spawn it never re-imports the caller's __main__ (a script without a
        # main guard, a notebook).
        import pickle
        import subprocess
        import sys
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        processes = []
        for rank_args in args:
            process = subprocess.Popen([sys.executable, "-m", "replicas.parallel.worker"],
                                       stdin=subprocess.PIPE, env=env)
            process.stdin.write(pickle.dumps(rank_args))
            process.stdin.close()
            processes.append(process)
        return processes

    def _start_ray(self, args, device: torch.device):
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = get_current_placement_group()
        actor_class = ray.remote(TensorParallelWorker)
        handles = []
        for rank_args in args:
            rank, threads = rank_args[2], rank_args[5]
            # Named (unique by the group's port) so that operators and tests can find a rank.
            options = dict(num_cpus=threads, num_gpus=1 if device.type == "cuda" else 0,
                           max_restarts=0, name=f"{RANK_ACTOR_PREFIX}{rank}-{rank_args[4]}")
            if group is not None:  # the bundle reserved for this rank (bundle 0 is the driver's)
                bundle = group.bundle_specs[rank]
                options.update(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   group, placement_group_bundle_index=rank))
            actor = actor_class.options(**options).remote(*rank_args)
            handles.append((actor, actor.run.remote()))
        return handles

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
            dead = self._dead_rank()
            if dead is not None and thread.is_alive():
                _stop(self.ray, self._handles, 0.0)
                raise RuntimeError(f"tensor-parallel rank {dead[0]} failed to start: {dead[1]}")
        if "error" in result:
            _stop(self.ray, self._handles, 0.0)
            raise result["error"]
        return result["tp"]

    def _dead_rank(self) -> tuple[int, str] | None:
        if not self.ray:
            for rank, process in enumerate(self._handles, start=1):
                if process.poll() is not None:
                    return rank, f"its process exited with code {process.returncode}"
            return None
        import ray
        refs = [ref for _, ref in self._handles]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for rank, ref in enumerate(refs, start=1):
            if ref in done:
                try:
                    ray.get(ref)
                    return rank, "its actor stopped"
                except Exception as exc:  # noqa: BLE001 - the actor's death is the answer
                    return rank, f"its actor died: {type(exc).__name__}"
        return None


def _release(ray_actors: bool, handles, group, wait_s: float = 0.0) -> None:
    """Leave the driver's group, then stop the ranks; takes no Workers, so that the finalizer
    holding it does not keep the Workers alive."""
    parallel_state.destroy(group)
    _stop(ray_actors, handles, wait_s)


def _stop(ray_actors: bool, handles, wait_s: float) -> None:
    """Wait up to wait_s for the ranks to leave (after the stop message), then end them."""
    deadline = time.monotonic() + wait_s
    if ray_actors:
        import ray
        refs = [ref for _, ref in handles]
        if wait_s:
            ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for actor, _ in handles:
            ray.kill(actor, no_restart=True)
        return
    for process in handles:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - still running: end it
            process.kill()
            process.wait(1.0)
