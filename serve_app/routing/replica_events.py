"""What the request router sees happen to the engine replicas, for the rest of its process: when
each last generated a token (readiness), which calls were in flight on a replica that died, and
the router itself (the ingress asks it where to send a request it sends without Ray).

Module state, not router state, because Ray Serve ships the router class to the ingress by value:
the class's own module globals are a private copy, while a module it imports, like this one, is
the process's one instance that the ingress imports too.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

# (app, deployment) -> {replica id: wall clock of its engine's last sampled token, or None}
_last_generation: dict[tuple[str, str], dict[str, float | None]] = {}
# Handle calls in flight: Ray Serve's internal request id -> replica id. A streaming call to a
# replica that was killed does not always end (seen under load with Ray Serve 2.60), so the
# ingress fails those calls itself when the router learns of the death.
_in_flight: dict[str, str] = {}
# Calls Ray Serve reported ended, for RECENTLY_ENDED_S: call -> (replica id, when). Ray reports
# a call to a killed replica as ended before it reports the death, and the ingress's stream of
# that call may still never end, so the death fails these too (the ingress's own end of a call,
# completed(), forgets it at once).
_recently_ended: dict[str, tuple[str, float]] = {}
RECENTLY_ENDED_S = 30.0
_lost_listeners: list[Callable[[str, set[str]], None]] = []
_routers: dict[tuple[str, str], Any] = {}  # (app, deployment) -> its PrefixAffinityRouter


def router_ready(app_name: str, deployment: str, router: Any) -> None:
    _routers[(app_name, deployment)] = router


def router_of(app_name: str, deployment: str) -> Any:
    """The PrefixAffinityRouter of this process's handle to the deployment, once Ray made it."""
    return _routers.get((app_name, deployment))


def replicas_seen(app_name: str, deployment: str,
                  last_generation: Iterable[tuple[str, float | None]]) -> None:
    _last_generation[(app_name, deployment)] = dict(last_generation)


def last_generation_times(app_name: str, deployment: str) -> dict[str, float | None] | None:
    """Per live replica, when it last generated; None when no router of ours has seen any."""
    return _last_generation.get((app_name, deployment))


def routed(call_id: str, replica_id: str) -> None:
    if call_id:
        _in_flight[call_id] = replica_id


def ended(call_id: str) -> None:
    """Ray Serve reported the call's end (its router's on_request_completed)."""
    replica_id = _in_flight.pop(call_id, None)
    if replica_id is None:
        return
    now = time.monotonic()
    _recently_ended[call_id] = (replica_id, now)
    while _recently_ended:  # oldest first: insertion order
        oldest = next(iter(_recently_ended))
        if now - _recently_ended[oldest][1] < RECENTLY_ENDED_S:
            break
        del _recently_ended[oldest]


def completed(call_id: str) -> None:
    """The ingress is done with the call."""
    _in_flight.pop(call_id, None)
    _recently_ended.pop(call_id, None)


def replica_died(replica_id: str) -> None:
    lost = {call for call, replica in _in_flight.items() if replica == replica_id}
    lost |= {call for call, (replica, _) in _recently_ended.items() if replica == replica_id}
    for call in lost:
        _in_flight.pop(call, None)
        _recently_ended.pop(call, None)
    for listener in _lost_listeners:
        listener(replica_id, lost)


def on_replica_lost(listener: Callable[[str, set[str]], None]) -> None:
    """listener(replica id, internal ids of the calls in flight on it) when it dies."""
    _lost_listeners.append(listener)
