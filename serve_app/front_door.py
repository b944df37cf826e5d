"""HTTPFrontDoor: an ingress replica serving the HTTP API itself, on the public address.

Through Ray Serve's proxy every server-sent event is a Ray message from the ingress replica to
the proxy, at a CPU cost in each of the two processes whatever the event holds: more than the
engine spends making the token on a small model. Here each ingress replica
runs its own uvicorn server on the same ASGI app, so an event is one socket write from the
process that formatted it. Every ingress replica on a node binds the same port with SO_REUSEPORT
and the kernel spreads connections over them; Ray handles to the ingress (other Ray jobs) are
unchanged.

Ray Serve does not count these requests, so the front door counts them itself: past
`max_ongoing` at once it answers 503 with Retry-After, and `drain` (the replica's shutdown, after
Ray Serve's own drain of handle calls) stops accepting, waits for the requests in flight, and
ends the streams still open just before the replica's time is up, each with an error event.
A rolling update briefly has old and new replicas on the port; connections still in the old
one's accept queue when it closes are refused (SO_REUSEPORT's known edge).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

from pagedserve.serve_app import errors

logger = logging.getLogger(__name__)

# Probes and scrapes are answered even when the door is full: a full ingress is alive.
UNCOUNTED_PATHS = frozenset({"/health", "/health/ready", "/metrics", "/version"})
# Where a door says whose it is: a port already served by anything else is refused (SO_REUSEPORT
# would otherwise share it silently, and half the connections would reach the other server).
DOOR_PATH = "/-/pagedserve-front-door"
# Kept back from the drain for open streams to send their last event before the replica is killed.
END_STREAMS_S = 1.0


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"the ingress cannot listen on {host}:{port} ({exc.strerror}); another "
                           f"program holds the port without SO_REUSEPORT: choose another `port`, "
                           f"or set direct_http=false to serve through Ray Serve's proxy") from None
    return sock


async def check_port_unclaimed(host: str, port: int, door_id: str) -> None:
    """Raise unless nothing listens on host:port or another door of this application does."""
    import httpx

    connect_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in connect_host:
        connect_host = f"[{connect_host}]"
    try:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            response = await client.get(f"http://{connect_host}:{port}{DOOR_PATH}")
    except httpx.ConnectError:
        return
    except httpx.HTTPError as exc:
        owner = f"something that does not answer HTTP ({type(exc).__name__})"
    else:
        try:
            owner_id = response.json().get("id") if response.status_code == 200 else None
        except (ValueError, AttributeError):  # not JSON, or not an object: not a door
            owner_id = None
        if owner_id == door_id:
            return
        owner = f"another pagedserve application ({owner_id})" if owner_id else "another server"
    raise RuntimeError(f"the ingress cannot serve {host}:{port}: {owner} listens there; choose "
                       f"another `port`, or set direct_http=false to serve through Ray Serve's "
                       f"proxy")


class HTTPFrontDoor:
    """`door_id` names the application: its replicas share the port, nobody else may."""

    def __init__(self, app, host: str, port: int, max_ongoing: int, retry_after_s: int,
                 door_id: str):
        self.app = app
        self.host, self.port = host, port
        self.door_id = door_id
        self.max_ongoing = max_ongoing
        self.retry_after_s = retry_after_s
        self.ongoing = 0
        self._server = None
        self._task: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        if scope["path"] == DOOR_PATH:
            from starlette.responses import JSONResponse
            await JSONResponse({"id": self.door_id})(scope, receive, send)
            return
        if self.ongoing >= self.max_ongoing:
            refusal = errors.unavailable(f"this ingress replica is serving {self.ongoing} "
                                         f"requests, its limit", self.retry_after_s)
            await refusal.to_response(scope["path"])(scope, receive, send)
            return
        self.ongoing += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.ongoing -= 1

    async def start(self) -> None:
        import uvicorn

        await check_port_unclaimed(self.host, self.port, self.door_id)
        sock = listening_socket(self.host, self.port)
        config = uvicorn.Config(self, lifespan="off", access_log=False, log_level="warning",
                                log_config=None, ws="none", timeout_graceful_shutdown=None)
        self._server = server = uvicorn.Server(config)
        # The replica's process owns its signals (Ray's shutdown path), not uvicorn.
        server.install_signal_handlers = lambda: None
        server.capture_signals = contextlib.nullcontext
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():  # failed before it listened: say why
                self._task.result()
                raise RuntimeError(f"the ingress HTTP server on {self.host}:{self.port} stopped")
            await asyncio.sleep(0.01)
        logger.info("ingress serving HTTP on %s:%d", self.host, self.port)

    async def drain(self, timeout_s: float, end_streams: Callable[[], None]) -> None:
        """Stop accepting connections and wait up to timeout_s for the requests in flight; then
        `end_streams()` (each open stream gets an error event and its end, rather than a cut
        connection when Ray Serve's controller ends the replica) and close."""
        if self._task is None or self._task.done():
            return
        logger.info("ingress HTTP server draining %d request(s)", self.ongoing)
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), max(timeout_s, 0.0))
            return
        except TimeoutError:
            logger.warning("ingress HTTP server: %d request(s) still open at the end of the "
                           "drain; ending them", self.ongoing)
        end_streams()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), END_STREAMS_S)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()


def application_id() -> str:
    """This Serve application, cluster-wide: the ingress replicas that may share a port (hashed:
    anyone who can reach the port may read it)."""
    import hashlib

    import ray
    from ray import serve

    name = f"{ray.get_runtime_context().gcs_address}/{serve.get_replica_context().app_name}"
    return hashlib.sha256(name.encode()).hexdigest()[:16]
