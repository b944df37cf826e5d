"""The engine core's output channels: ingress replicas connected straight to the core.

An ingress replica that has met an engine replica connects to the core behind it over TCP (the
address comes with the replica's `ReplicaHello`), names its channel, and from then on receives
the outputs of its requests here, one message per engine step for all of them: the replica's
process, and a Ray message per step, are off the token path. A request's own Ray call still
carries its routing, its `max_ongoing_requests` slot, its errors and its cancellation; the core
tells the replica only that a request routed here has finished.

Which way a request's outputs go is fixed when it arrives (`route`), so one request never
streams on both. A connection is trusted once it has sent this core's token (made here, handed
out only in the replica's Ray messages); nothing it sends is ever unpickled. A subscriber that
goes away, or cannot take a step's outputs within SEND_TIMEOUT_S, loses its requests: the core
aborts them and fails them to the replica (their calls then end with an error).

Pure Python: no torch, no Ray.
"""
from __future__ import annotations

import logging
import secrets
import socket

from replicas import core_wire as wire

logger = logging.getLogger(__name__)

# A step's outputs must leave within this; a subscriber that stalls longer is dropped.
SEND_TIMEOUT_S = 5.0
_SNDBUF = 4 << 20


class CoreChannels:
    def __init__(self, host: str):
        self.listener = socket.create_server((host, 0), family=_family(host), backlog=64)
        self.listener.setblocking(False)
        self.token = secrets.token_hex(wire.CHANNEL_TOKEN_BYTES // 2)
        self.address = (host, self.listener.getsockname()[1], self.token)
        self._hellos: dict[socket.socket, bytes] = {}  # connected, not yet named
        self._subscribers: dict[str, socket.socket] = {}  # channel id -> its connection
        self._channel_of: dict[socket.socket, str] = {}
        self._routes: dict[str, str] = {}  # request id -> channel id
        self.num_outputs = 0  # sent on channels, for stats
        self.changed = False  # a subscriber came or went since the core last looked (stats)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def sockets(self) -> list[socket.socket]:
        return [self.listener, *self._hellos, *self._channel_of]

    def close(self) -> None:
        for sock in self.sockets():
            sock.close()

    # -- connections ------------------------------------------------------------------------------
    def on_readable(self, sock: socket.socket) -> list[str]:
        """Handle what `sock` has (a connection, a hello, or a close); the requests lost with a
        subscriber that closed."""
        if sock is self.listener:
            self._accept()
            return []
        try:
            data = sock.recv(wire.CHANNEL_HELLO_SIZE)
        except OSError:
            data = b""
        if sock in self._hellos:
            return self._hello(sock, data)
        if not data:  # a subscriber sends nothing after its hello: this is its end
            return self._drop(sock)
        logger.debug("an output channel sent unexpected bytes; dropping it")
        return self._drop(sock)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        self._hellos[sock] = b""

    def _hello(self, sock: socket.socket, data: bytes) -> list[str]:
        got = self._hellos[sock] + data
        if not data or len(got) > wire.CHANNEL_HELLO_SIZE:
            del self._hellos[sock]
            sock.close()
            return []
        if len(got) < wire.CHANNEL_HELLO_SIZE:
            self._hellos[sock] = got
            return []
        del self._hellos[sock]
        token, channel_id = wire.parse_channel_hello(got)
        if not secrets.compare_digest(token, self.token.encode()):
            sock.close()
            return []
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        sock.settimeout(SEND_TIMEOUT_S)  # sends block, for at most this long
        lost = []
        old = self._subscribers.get(channel_id)
        if old is not None:  # the ingress reconnected: its old connection's requests are gone
            lost = self._drop(old)
        self._subscribers[channel_id] = sock
        self._channel_of[sock] = channel_id
        self.changed = True
        return lost

    def _drop(self, sock: socket.socket) -> list[str]:
        channel_id = self._channel_of.pop(sock, None)
        sock.close()
        if channel_id is None or self._subscribers.get(channel_id) is not sock:
            return []
        del self._subscribers[channel_id]
        self.changed = True
        lost = [rid for rid, cid in self._routes.items() if cid == channel_id]
        for request_id in lost:
            del self._routes[request_id]
        return lost

    # -- requests ---------------------------------------------------------------------------------
    def route(self, request_id: str, channel_id: str | None) -> None:
        """Send this request's outputs to its channel, if that channel is connected now."""
        if channel_id is not None and channel_id in self._subscribers:
            self._routes[request_id] = channel_id

    def forget(self, request_id: str) -> bool:
        """The request ended otherwise (aborted, failed); whether it was routed here."""
        return self._routes.pop(request_id, None) is not None

    def send(self, outputs: list) -> tuple[list, list[str], list[str]]:
        """Send every routed output of a step to its channel: (the outputs that stay with the
        replica, the ids of routed requests that finished, the ids lost with a subscriber that
        could not take them)."""
        if not self._routes:
            return outputs, [], []
        rest, done, by_channel = [], [], {}
        routes = self._routes
        for output in outputs:
            channel_id = routes.get(output.request_id)
            if channel_id is None:
                rest.append(output)
                continue
            by_channel.setdefault(channel_id, []).append(output.wire())
            if output.finished:
                del routes[output.request_id]
                done.append(output.request_id)
        lost: list[str] = []
        for channel_id, batch in by_channel.items():
            sock = self._subscribers[channel_id]
            try:
                sock.sendall(wire.frame((wire.STEP, batch)))
                self.num_outputs += len(batch)
            except OSError as exc:  # gone, or stalled past SEND_TIMEOUT_S
                logger.debug("output channel %s failed: %r", channel_id, exc)
                failed = {values[0] for values in batch}
                done = [rid for rid in done if rid not in failed]
                lost += [rid for rid in failed if rid not in routes]  # finished but not delivered
                lost += self._drop(sock)
        return rest, done, lost


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
