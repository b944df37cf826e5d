"""The wire between a replica and its engine-core process: pickles, each behind an 8-byte length,
over one Unix socket pair. Pure Python (both ends import it; neither needs torch for it).

The core's first message is its config (a dict); after that messages are tuples whose first item
says what they are. To the core: `ADD` (with the output channel the request names, if any),
`ABORT`, `CALL` (a named method with keyword arguments, answered by a `REPLY`), `STOP`. From the
core: `READY` (or `FAILED`) once, then `STEP` (every output of one engine step that stays with the
replica, the requests that failed, the engine's stats when they are due, and the requests that
finished on an output channel: one message per step, never one per token), `REPLY`, and `DEAD`
if its loop stops.

An output channel (`replicas/core_channels.py`) is a TCP connection from an ingress replica to
the core: it opens with a fixed-size hello (the core's token, then the channel's id: plain bytes,
never a pickle), then carries `STEP` frames (the step's outputs for that ingress) one way.
"""
from __future__ import annotations

import pickle
import struct

ADD, ABORT, CALL, STOP = "add", "abort", "call", "stop"
READY, FAILED, STEP, REPLY, DEAD = "ready", "failed", "step", "reply", "dead"

_HEADER = struct.Struct("!Q")
CHANNEL_TOKEN_BYTES = 32  # hex characters
CHANNEL_ID_BYTES = 32  # a uuid4's hex
CHANNEL_HELLO_SIZE = CHANNEL_TOKEN_BYTES + CHANNEL_ID_BYTES


def frame(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def channel_hello(token: str, channel_id: str) -> bytes:
    hello = (token + channel_id).encode("ascii")
    if len(token) != CHANNEL_TOKEN_BYTES or len(hello) != CHANNEL_HELLO_SIZE:
        raise ValueError("a channel hello is a core token and a uuid4 hex")
    return hello


def parse_channel_hello(hello: bytes) -> tuple[bytes, str]:
    """(token, channel id) of a hello of CHANNEL_HELLO_SIZE bytes (the id undecodable: "")."""
    token, channel_id = hello[:CHANNEL_TOKEN_BYTES], hello[CHANNEL_TOKEN_BYTES:]
    return token, channel_id.decode("ascii", errors="replace")


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any unpicklable error still has to reach the caller
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class FrameReader:
    """Bytes in, whole messages out: a frame split across reads waits for its rest."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        buffer = self._buffer
        buffer += data
        messages, start, size = [], 0, len(buffer)
        with memoryview(buffer) as view:  # released before the buffer shrinks
            while size - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(view, start)
                end = start + _HEADER.size + length
                if end > size:
                    break
                messages.append(pickle.loads(view[start + _HEADER.size:end]))
                start = end
        if start:
            del buffer[:start]
        return messages
