"""The engine core's end of its clients' connections: one TCP connection from each ingress replica,
both ways (`replicas/engine/protocol.py`).

A connection is trusted once its `Hello` carries this core's token (made here, published only
through Ray Serve, by the core's replica). Each client's requests are its own: only it may abort
them, and when its connection goes away the core aborts them all and frees their KV blocks. Sends
block for at most SEND_TIMEOUT_S: a client that cannot take a step's outputs by then is dropped
rather than stall every other client's streams.
"""
from __future__ import annotations

import logging
import secrets
import socket

from pagedserve.replicas.engine import protocol

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0
_READ_SIZE = 1 << 20
# Room for a burst of steps' outputs while an ingress is busy, so the core rarely blocks on it.
_SNDBUF = 4 << 20


class Client:
    """One connected ingress: its socket, its reader, and the requests it sent that have not
    ended."""

    __slots__ = ("sock", "reader", "client_id", "requests", "num_queued")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = protocol.core_reader()
        self.client_id: str | None = None  # set by its Hello
        self.requests: set[str] = set()
        self.num_queued = 0  # QueuedHere: requests it holds that rank this core first


class CoreServer:
    def __init__(self, host: str):
        self.token = secrets.token_hex(16)
        self.listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.listener.bind((host, 0))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.address = (host, self.listener.getsockname()[1], self.token)
        self.clients: dict[socket.socket, Client] = {}
        self.received: list[tuple[Client, object]] = []  # (client, message) since the last take
        self.lost: list[str] = []  # requests of clients that went away
        self.joined = False  # a client said Hello since the last take: it needs a full digest

    def sockets(self) -> list[socket.socket]:
        return [self.listener, *self.clients]

    @property
    def num_queued(self) -> int:
        return sum(client.num_queued for client in self.clients.values())

    def on_readable(self, sock: socket.socket) -> None:
        if sock is self.listener:
            return self._accept()
        client = self.clients.get(sock)
        if client is None:
            return
        try:
            data = sock.recv(_READ_SIZE)
        except OSError:
            data = b""
        if not data:
            return self.drop(client)
        try:
            messages = client.reader.feed(data)
        except ValueError as exc:  # not frames of ours
            logger.debug("a client sent a bad frame (%s); dropping it", exc)
            return self.drop(client)
        for message in messages:
            if client.client_id is None:
                if not self._hello(client, message):
                    return self.drop(client)
            else:
                self.received.append((client, message))

    def take_received(self) -> list[tuple[Client, object]]:
        received = self.received
        if received:  # asked every step: no new list while nothing came
            self.received = []
        return received

    def take_lost(self) -> list[str]:
        lost = self.lost
        if lost:
            self.lost = []
        return lost

    def send(self, client: Client, message: protocol.CoreOutputs) -> None:
        try:
            client.sock.sendall(protocol.frame(message))
        except OSError as exc:  # gone, or stalled past SEND_TIMEOUT_S
            logger.debug("client %s failed: %r", client.client_id, exc)
            self.drop(client)

    def broadcast(self, message: protocol.CoreOutputs) -> None:
        for client in [c for c in self.clients.values() if c.client_id is not None]:
            self.send(client, message)

    def drop(self, client: Client) -> None:
        if self.clients.pop(client.sock, None) is None:
            return
        client.sock.close()
        self.lost += client.requests
        client.requests = set()

    def close(self) -> None:
        for client in list(self.clients.values()):
            self.drop(client)
        self.listener.close()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        self.clients[sock] = Client(sock)

    def _hello(self, client: Client, message: object) -> bool:
        if not isinstance(message, protocol.Hello) or message.version != protocol.PROTOCOL_VERSION:
            logger.warning("a client spoke another protocol (%r); dropping it", type(message).__name__)
            return False
        if not secrets.compare_digest(message.token, self.token):
            return False
        sock = client.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        # Each step's frame leaves at once: Nagle's wait for the client's delayed acks would hold
        # frames back by tens of milliseconds.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(SEND_TIMEOUT_S)  # sends block, for at most this long
        client.client_id = message.client_id
        self.joined = True
        return True
