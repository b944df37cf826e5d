"""One process's place in a tensor-parallel group: its rank, the world size, the process groups,
and the two collectives the sharded layers need (all-reduce, gather to rank 0).

A process is one rank for its whole life, so the state is made once (`init`) and handed to the
model while it is built (`building`): each sharded module keeps the `TensorParallel` it was built
with, and nothing reads a global at forward time. World size 1 is `SINGLE`, whose layers run no
collective and hold no group.

Two groups: `group` carries the activations (NCCL on CUDA, gloo on CPU) with a short timeout, so a
rank that stops answering fails the step instead of hanging it; `cpu_group` (always gloo) carries
the driver's per-step input, and its timeout is an idle replica's longest wait between steps.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch

# A collective on activations that takes longer than this means a rank is gone (or stopped).
COLLECTIVE_TIMEOUT_S = 60.0
# Workers wait this long for the next step: an engine idle for longer loses its workers (and
# fails its health check, so Ray Serve replaces it).
IDLE_TIMEOUT_S = 30 * 24 * 3600.0


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup for activations
    cpu_group: Any = None  # gloo, for step inputs

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def split(self, size: int, what: str = "size") -> tuple[int, int]:
        """[start, stop) of this rank's even share of `size` rows."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size "
                             f"({self.world_size})")
        share = size // self.world_size
        return self.rank * share, (self.rank + 1) * share

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, stop) of this rank's vocabulary rows: ceil(vocab / tp) each, the last fewer."""
        share = -(-vocab_size // self.world_size)
        start = min(self.rank * share, vocab_size)
        return start, min(start + share, vocab_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[N, this rank's vocab rows] -> [N, vocab] on rank 0, None elsewhere."""
        import torch.distributed as dist
        share = -(-vocab_size // self.world_size)
        if logits.shape[-1] < share:  # the last rank's short shard: gather needs equal sizes
            logits = torch.nn.functional.pad(logits, (0, share - logits.shape[-1]))
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(logits, parts, dst=0, group=self.group)
        if not self.is_driver:
            return None
        return torch.cat(parts, dim=-1)[..., :vocab_size]


SINGLE = TensorParallel()
_building: TensorParallel = SINGLE


def current() -> TensorParallel:
    """The group of the model being built (SINGLE outside `building`)."""
    return _building


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """Build a model inside this block to shard it for `tp`."""
    global _building
    previous, _building = _building, tp
    try:
        yield
    finally:
        _building = previous


def free_address() -> str:
    """host:port of a free TCP port on this host, for the group's rendezvous store."""
    host = os.environ.get("PAGEDSERVE_TP_HOST", "127.0.0.1")
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


def init(rank: int, world_size: int, address: str, device: torch.device,
         timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TensorParallel:
    """Join the group at `address` (rank 0 hosts its store); returns this rank's state."""
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group: shut the "
                           "other engine down first (LLM.shutdown())")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    return TensorParallel(rank, world_size, group, cpu_group)


def destroy(group: Any) -> None:
    """Leave this process's group if it is still `group` (the one `init` made): a finalizer that
    runs late must not end a newer engine's group."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()
