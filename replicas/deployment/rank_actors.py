"""Tensor-parallel ranks 1..N-1 as Ray actors, for an engine that runs inside a Ray worker (a
Serve replica): each rank takes the bundle its replica's placement group reserved for it."""
from __future__ import annotations

RANK_ACTOR_PREFIX = "pagedserve-tp-rank"


def ray_is_running() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


class RayRanks:
    """The same calls as `parallel.executor.LocalRanks`: dead_rank and stop."""

    def __init__(self, args: list[tuple], device):
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedserve.replicas.parallel.worker import TensorParallelWorker

        group = get_current_placement_group()
        actor_class = ray.remote(TensorParallelWorker)
        self.actors, self.runs = [], []
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
            self.actors.append(actor)
            self.runs.append(actor.run.remote())

    def dead_rank(self) -> tuple[int, str] | None:
        import ray
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for rank, ref in enumerate(self.runs, start=1):
            if ref in done:
                try:
                    ray.get(ref)
                    return rank, "its actor stopped"
                except Exception as exc:  # noqa: BLE001 - the actor's death is the answer
                    return rank, f"its actor died: {type(exc).__name__}"
        return None

    def stop(self, wait_s: float) -> None:
        """Wait up to wait_s for the ranks to leave (after the stop message), then end them."""
        import ray
        if wait_s:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=wait_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
