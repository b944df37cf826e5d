"""The engine protocol: every message between an ingress and an engine core, and between an engine
replica and the core it supervises, declared once.

Messages are msgspec Structs, named in code and positional on the wire (`array_like`: a list
whose first item is the message's tag), encoded as MessagePack behind a 4-byte length. One codec
both ways; nothing on the wire is ever unpickled. A client opens with `Hello` (the protocol's
version and the core's token); the core answers a version it does not speak by closing.

    ingress -> core:  Hello, AddRequest, Abort, QueuedHere, LoadAdapter, UnloadAdapter
    core -> ingress:  CoreOutputs (one per engine step with something for that ingress), AdapterLoaded
    replica -> core:  Start, Drain, Stop          core -> replica:  Ready | StartFailed, Stats, Died

A request's outputs are `pagedserve.replicas.core.outputs.RequestOutput` deltas carrying token ids: the ingress
makes their text (`serve_app/stream_text.py`).
"""
from __future__ import annotations

import struct
from typing import Any, Union

import msgspec

from pagedserve.replicas.core.cache_digest import StepReport
from pagedserve.replicas.core.lora_request import LoRARequest
from pagedserve.replicas.core.outputs import RequestOutput
from pagedserve.replicas.core.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 256 << 20  # a frame larger than this is a broken peer, not a message


class _Message(msgspec.Struct, array_like=True, tag=True, omit_defaults=False):
    pass


# -- ingress -> core --------------------------------------------------------------------------------
class Hello(_Message):
    """A client's first message: who it is, and the token the core's replica published."""

    version: int
    token: str
    client_id: str


class AddRequest(_Message):
    """One prompt to generate from (or to pool, under `params.pooling`), already tokenized and
    checked by the ingress."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    block_hashes: list[int] | None = None  # the prompt's prefix-cache chain, as the router hashed it
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model


class LoadAdapter(_Message):
    """Load and check an adapter now (POST /v1/load_lora_adapter): the core answers
    `AdapterLoaded`. Requests need not wait for it: one naming an adapter the core lacks
    waits while the core loads it."""

    request_id: str
    lora: LoRARequest


class Abort(_Message):
    request_ids: list[str]


class QueuedHere(_Message):
    """Requests the ingress holds, waiting for room, that rank this core first: the core counts
    them in the queue depth it reports for autoscaling."""

    num_requests: int


class UnloadAdapter(_Message):
    """Forget an adapter (POST /v1/unload_lora_adapter); its requests in flight finish with it."""

    lora_int_id: int


# -- core -> ingress --------------------------------------------------------------------------------
REFUSED = "refused"  # the core is full or draining: the ingress tries the next replica
INVALID = "invalid"  # the request is bad (400, naming `param`)
STEP_FAILED = "step_failed"  # the engine step that ran the request failed; the engine serves on


class Failure(msgspec.Struct, array_like=True):
    """A request that ends with an error instead of an output."""

    request_id: str
    kind: str  # REFUSED, INVALID or STEP_FAILED
    message: str
    param: str | None = None


class CoreOutputs(_Message):
    """One engine step's news for one ingress: its requests' outputs and failures, the core's
    queue as of the step (for the ingress's router), and, about once a second, the core's
    routing digest (`pagedserve.replicas.core.cache_digest.RoutingReporter.report`)."""

    outputs: list[RequestOutput]
    failures: list[Failure] = []
    report: StepReport | None = None
    digest: dict[str, Any] | None = None
    draining: bool = False  # the core takes no new requests: route elsewhere


class AdapterLoaded(_Message):
    """The answer to `LoadAdapter`: error None, or why the adapter cannot be served (a 400)."""

    request_id: str
    error: str | None = None


# -- replica <-> core -------------------------------------------------------------------------------
class Start(_Message):
    """What a core is started with, by the replica that supervises it."""

    config: dict[str, Any]  # an EngineConfig's fields
    host: str  # where it listens for its clients
    max_requests: int | None = None  # it refuses new requests while it holds this many
    probe_interval_s: float | None = 10.0  # idle this long, it proves it can generate; None: never
    engine_class: str | None = None  # "module:Class" of another engine (tests, custom engines)


class Ready(_Message):
    info: dict[str, Any]  # model facts, the pickled tokenizer, the address ingresses connect to


class StartFailed(_Message):
    message: str
    traceback: str


class Stats(_Message):
    stats: dict[str, Any]


class Died(_Message):
    message: str


class Drain(_Message):
    """Take no new requests; those held run to their end."""


class Stop(_Message):
    pass


ToCore = Union[Hello, AddRequest, Abort, QueuedHere, LoadAdapter, UnloadAdapter, Start, Drain, Stop]
FromCore = Union[CoreOutputs, AdapterLoaded, Ready, StartFailed, Stats, Died]

_encoder = msgspec.msgpack.Encoder()


def frame(message: _Message) -> bytes:
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Bytes in, whole messages out: a frame split across reads waits for its rest. Raises
    ValueError (msgspec's DecodeError is one) for a frame that is not one of `message_type`."""

    def __init__(self, message_type: Any):
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        buffer = self._buffer
        buffer += data
        messages, start, size = [], 0, len(buffer)
        decode = self._decoder.decode
        with memoryview(buffer) as view:  # released before the buffer shrinks
            while size - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(view, start)
                if length > MAX_FRAME_BYTES:
                    raise ValueError(f"a frame of {length} bytes is over {MAX_FRAME_BYTES}")
                end = start + _HEADER.size + length
                if end > size:
                    break
                messages.append(decode(view[start + _HEADER.size:end]))
                start = end
        if start:
            del buffer[:start]
        return messages


def core_reader() -> FrameReader:
    return FrameReader(ToCore)


def client_reader() -> FrameReader:
    return FrameReader(FromCore)
