"""Requests waiting for their grammar: outside the scheduler until it has compiled."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

from pagedserve.replicas.core.request import Request
from pagedserve.replicas.core.sampling_params import ParamError
from pagedserve.replicas.core.sequence import SequenceStatus
from pagedserve.replicas.structured.matcher import GrammarMatcher


def attach_grammar(request: Request) -> None:
    """Give each of the request's sequences its own matcher; raises the ParamError of a grammar
    that failed to compile."""
    start = request.grammar.result()
    for seq in request.seqs:
        seq.grammar = GrammarMatcher(start.deep_copy())


class PendingGrammars:
    """`add` a request whose grammar is compiling; `take_ready()` hands back those now ready
    (matchers attached) and keeps those that failed, as (request_id, ParamError), in `failures`."""

    def __init__(self) -> None:
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
            if not request.grammar.done():
                continue
            del self.requests[request_id]
            try:
                attach_grammar(request)
            except ParamError as exc:
                for seq in request.seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                self.failures.append((request_id, exc))
                continue
            ready.append(request)
        return ready

    def wait(self, timeout_s: float) -> None:
        """Block until one grammar is done or timeout_s passed (when the engine has nothing
        else to do: better than spinning)."""
        wait([r.grammar for r in self.requests.values()], timeout=timeout_s,
             return_when=FIRST_COMPLETED)
