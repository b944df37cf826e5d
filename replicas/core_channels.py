"""The engine core's output channels: ingress replicas connected straight to the core.

An ingress replica that has met an engine replica connects to the core behind it over TCP (the
address comes with the replica's `ReplicaHello`), names its channel, and from then on receives
the outputs of its requests here, one message per engine step for all of them: the replica's
process, and a Ray message per step, are off the token path.

A request reaches the core one of two ways. By its own Ray call to the replica, which carries
its routing, its `max_ongoing_requests` slot, its errors and its cancellation; the core then
tells the replica only that a request routed here has finished. Or on the channel itself
(`direct`): the ingress chose the replica with the same router, and sends the request, and later
its abort, as a JSON frame; the core takes it while it holds fewer requests than the replica's
`max_ongoing_requests` (else it refuses it, `CoreRefused`, and the ingress goes elsewhere), and
its errors come back on the channel. No Ray message, and no replica process, is on that path.

Which way a request's outputs go is fixed when it arrives (`route`, `accept`), so one request
never streams on both. A connection is trusted once it has sent this core's token (made here,
handed out only in the replica's Ray messages); nothing it sends is ever unpickled. A subscriber
that goes away, or cannot take a step's outputs within SEND_TIMEOUT_S, loses its requests: the
core aborts them, and fails those that came by Ray to the replica (their calls end with an error).

Pure Python: no torch, no Ray.
"""
from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Callable

from replicas import core_wire as wire
from replicas.outputs import RequestOutput

logger = logging.getLogger(__name__)

# A step's outputs must leave within this; a subscriber that stalls longer is dropped.
SEND_TIMEOUT_S = 5.0
_SNDBUF = 4 << 20
_READ_SIZE = 1 << 20
# An ingress's frame is one request: its prompt's ids and settings. Past this it is not one.
MAX_CHANNEL_FRAME = 64 << 20


class CoreChannels:
    def __init__(self, host: str):
        self.listener = socket.create_server((host, 0), family=_family(host), backlog=64)
        self.listener.setblocking(False)
        self.token = secrets.token_hex(wire.CHANNEL_TOKEN_BYTES // 2)
        self.address = (host, self.listener.getsockname()[1], self.token)
        self._hellos: dict[socket.socket, bytes] = {}  # connected, not yet named
        self._subscribers: dict[str, socket.socket] = {}  # channel id -> its connection
        self._channel_of: dict[socket.socket, str] = {}
        self._readers: dict[socket.socket, wire.FrameReader] = {}
        self._routes: dict[str, str] = {}  # request id -> channel id
        self._direct: set[str] = set()  # routed requests that came on their channel
        self.received: list[tuple[str, list]] = []  # (channel id, message) from the ingresses
        self.abandoned: list[str] = []  # direct requests whose channel went away: to abort
        self.num_outputs = 0  # sent on channels, for stats
        self.num_requests = 0  # taken on channels (no Ray call), for stats
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
        """Handle what `sock` has (a connection, a hello, messages for `received`, or a close);
        the requests that came by Ray lost with a subscriber that closed."""
        if sock is self.listener:
            self._accept()
            return []
        hello = self._hellos.get(sock)
        try:  # never read past a hello: a request may follow it at once
            data = sock.recv(wire.CHANNEL_HELLO_SIZE - len(hello) if hello is not None
                             else _READ_SIZE)
        except OSError:
            data = b""
        if hello is not None:
            return self._hello(sock, data)
        if not data:
            return self._drop(sock)
        try:
            messages = self._readers[sock].feed(data)
        except (ValueError, RecursionError) as exc:  # not JSON frames of ours
            logger.debug("an output channel sent a bad frame (%s); dropping it", exc)
            return self._drop(sock)
        channel_id = self._channel_of[sock]
        self.received += [(channel_id, message) for message in messages]
        return []

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
        # Each step's frame leaves at once: with the ingress sending requests on the connection
        # too, Nagle's wait for its (delayed) acks held frames back by up to ~40 ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(SEND_TIMEOUT_S)  # sends block, for at most this long
        lost = []
        old = self._subscribers.get(channel_id)
        if old is not None:  # the ingress reconnected: its old connection's requests are gone
            lost = self._drop(old)
        self._subscribers[channel_id] = sock
        self._channel_of[sock] = channel_id
        self._readers[sock] = wire.FrameReader(wire.channel_loads, MAX_CHANNEL_FRAME)
        self.changed = True
        return lost

    def _drop(self, sock: socket.socket) -> list[str]:
        channel_id = self._channel_of.pop(sock, None)
        self._readers.pop(sock, None)
        sock.close()
        if channel_id is None or self._subscribers.get(channel_id) is not sock:
            return []
        del self._subscribers[channel_id]
        self.changed = True
        lost = []
        for request_id in [rid for rid, cid in self._routes.items() if cid == channel_id]:
            del self._routes[request_id]
            if request_id in self._direct:  # nobody is left to tell: abort it only
                self._direct.discard(request_id)
                self.abandoned.append(request_id)
            else:
                lost.append(request_id)
        return lost

    # -- requests ---------------------------------------------------------------------------------
    def route(self, request_id: str, channel_id: str | None) -> None:
        """Send this request's outputs to its channel, if that channel is connected now."""
        if channel_id is not None and channel_id in self._subscribers:
            self._routes[request_id] = channel_id

    def accept(self, request_id: str, channel_id: str) -> None:
        """A request that came on its channel (the core has taken it): everything it produces,
        outputs and errors, goes back there."""
        self._routes[request_id] = channel_id
        self._direct.add(request_id)
        self.num_requests += 1

    def sent_by(self, request_id: str, channel_id: str) -> bool:
        """Whether request_id came on channel_id (only its own ingress may abort it)."""
        return request_id in self._direct and self._routes.get(request_id) == channel_id

    def refuse(self, channel_id: str, request_id: str, error: BaseException) -> list[str]:
        """Answer a request the core did not take with its error, at once; the requests that
        came by Ray lost if the channel has failed."""
        sock = self._subscribers.get(channel_id)
        if sock is None:
            return []
        try:
            sock.sendall(wire.channel_step([], [(request_id, wire.portable(error))]))
        except OSError as exc:
            logger.debug("output channel %s failed: %r", channel_id, exc)
            return self._drop(sock)
        return []

    def forget(self, request_id: str) -> bool:
        """The request ended otherwise (aborted); whether it was routed here."""
        self._direct.discard(request_id)
        return self._routes.pop(request_id, None) is not None

    def take_received(self) -> list[tuple[str, list]]:
        received = self.received
        if received:  # the core asks every step: no new list while nothing came
            self.received = []
        return received

    def take_abandoned(self) -> list[str]:
        abandoned = self.abandoned
        if abandoned:
            self.abandoned = []
        return abandoned

    def send(self, outputs: list[tuple], errors: list[tuple[str, BaseException]],
             step_report: Callable[[], tuple] | None = None
             ) -> tuple[list, list, list[str], list[str]]:
        """Send every routed output of a step (`RequestOutput.wire()` values), and the errors of
        requests that came on a channel, to their channel, each frame with the step's
        `step_report()` (the replica's load for the ingress's router, taken once a step has
        something to send): (the outputs and the errors that stay with the replica, the ids of
        requests routed here by Ray that finished, the ids of those lost with a subscriber that
        could not take them)."""
        if not self._routes:
            return outputs, errors, [], []
        rest, done, by_channel = [], [], {}
        routes, direct = self._routes, self._direct
        for output in outputs:
            request_id = output[0]
            channel_id = routes.get(request_id)
            if channel_id is None:
                rest.append(output)
                continue
            by_channel.setdefault(channel_id, ([], []))[0].append(output)
            if RequestOutput.finished_on_wire(output):
                del routes[request_id]
                if request_id in direct:
                    direct.discard(request_id)
                else:
                    done.append(request_id)
        rest_errors = []
        for request_id, exc in errors:
            channel_id = routes.pop(request_id, None)
            if request_id in direct:
                direct.discard(request_id)
                by_channel.setdefault(channel_id, ([], []))[1].append(
                    (request_id, wire.portable(exc)))
            else:
                rest_errors.append((request_id, exc))
        lost: list[str] = []
        # A plain tuple on the wire: a NamedTuple pickles with its class's name.
        report = tuple(step_report()) if by_channel and step_report is not None else None
        for channel_id, (batch, failed_requests) in by_channel.items():
            sock = self._subscribers[channel_id]
            try:
                sock.sendall(wire.channel_step(batch, failed_requests, report))
                self.num_outputs += len(batch)
            except OSError as exc:  # gone, or stalled past SEND_TIMEOUT_S
                logger.debug("output channel %s failed: %r", channel_id, exc)
                failed = {values[0] for values in batch}
                # Finished but not delivered: those that came by Ray fail to the replica.
                lost += [rid for rid in done if rid in failed]
                done = [rid for rid in done if rid not in failed]
                lost += self._drop(sock)
        return rest, rest_errors, done, lost


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
