"""CoreLink: this ingress replica's connection to one engine core, both ways.

It connects to the address the core's replica published (`serve_app/core_directory.py`), says
`Hello`, then writes requests and aborts as they come and reads one `CoreOutputs` per engine step
that had something for this ingress, and the answers to its adapter loads
(`replicas/engine/protocol.py`), handing each to its `EngineClient`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from pagedserve.replicas.engine import protocol

if TYPE_CHECKING:
    from pagedserve.serve_app.engine_client import EngineClient
    from pagedserve.serve_app.request_stream import RequestStream

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
_READ_SIZE = 1 << 20


class CoreLink:
    def __init__(self, replica_id: str, address: tuple[str, int, str]):
        self.replica_id = replica_id
        self.address = address
        self.requests: dict[str, RequestStream] = {}  # sent here and not ended
        self.writer: asyncio.StreamWriter | None = None
        self.connected = False
        self.closed = False
        self.draining = False  # the core said it takes no more requests
        self.withdrawn = False  # its replica left the directory: it is stopping
        self.num_queued = 0  # QueuedHere last sent

    @property
    def usable(self) -> bool:
        return self.connected and not (self.closed or self.draining or self.withdrawn)

    async def run(self, client: EngineClient) -> None:
        """Connect, then read until the connection ends; `client.link_closed` hears the end."""
        host, port, token = self.address
        try:
            reader, self.writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                         CONNECT_TIMEOUT_S)
            self.writer.write(protocol.frame(protocol.Hello(protocol.PROTOCOL_VERSION, token,
                                                            client.client_id)))
            self.connected = True
            client.link_usable(self)
            frames = protocol.client_reader()
            while data := await reader.read(_READ_SIZE):
                for message in frames.feed(data):
                    client.on_message(self, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the requests on it hear of it below
            logger.debug("connection to the core of replica %s ended: %r", self.replica_id, exc)
        finally:
            self.close()
            client.link_closed(self)

    def add(self, stream: RequestStream) -> None:
        self.requests[stream.request_id] = stream
        self.writer.write(protocol.frame(stream.request))

    def abort(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None and not self.closed:
            self.writer.write(protocol.frame(protocol.Abort([request_id])))

    def send(self, message) -> None:
        """A control message (LoadAdapter, UnloadAdapter)."""
        self.writer.write(protocol.frame(message))

    def queued(self, num_requests: int) -> None:
        if num_requests != self.num_queued and self.connected and not self.closed:
            self.num_queued = num_requests
            self.writer.write(protocol.frame(protocol.QueuedHere(num_requests)))

    def close(self) -> None:
        self.closed = True
        if self.writer is not None:
            self.writer.close()
