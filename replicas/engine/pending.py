"""Requests waiting for what they need before they can be scheduled: their grammar compiled, their
LoRA adapter loaded. Both happen off the engine loop; the requests stay outside the scheduler
until then."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait

from pagedserve.replicas.core.request import Request
from pagedserve.replicas.core.sampling_params import ParamError
from pagedserve.replicas.core.sequence import SequenceStatus


class PendingRequests:
    """`add` a request whose grammar or adapter is not ready; `take_ready()` hands back those now
    ready (passed through `admit`, which raises the ParamError of what failed) and keeps those
    that failed, as (request_id, ParamError), in `failures`."""

    def __init__(self, admit: Callable[[Request], None]) -> None:
        self.admit = admit
        self.requests: dict[str, Request] = {}
        self.failures: list[tuple[str, ParamError]] = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def pop(self, request_id: str) -> Request | None:
        return self.requests.pop(request_id, None)

    def take_ready(self) -> list[Request]:
        ready = []
        for request_id, request in list(self.requests.items()):
            if not all(f.done() for f in request.waits_on()):
                continue
            del self.requests[request_id]
            try:
                self.admit(request)
            except ParamError as exc:
                for seq in request.seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                self.failures.append((request_id, exc))
                continue
            ready.append(request)
        return ready

    def wait(self, timeout_s: float) -> None:
        """Block until one of them is done or timeout_s passed (when the engine has nothing
        else to do: better than spinning)."""
        futures = [f for r in self.requests.values() for f in r.waits_on()]
        wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
