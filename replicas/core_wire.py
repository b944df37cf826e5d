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
never a pickle). The core then sends it `STEP` frames (the step's outputs for that ingress, the
errors of the requests it sent itself, and the core's queue depth as of the step, for the
ingress's router); the ingress may send it requests (`ADD`) and aborts
(`ABORT`) as JSON frames, which the core validates like any input.
"""
from __future__ import annotations

import json
import pickle
import struct
from dataclasses import fields
from typing import Any

from replicas.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

ADD, ABORT, CALL, STOP = "add", "abort", "call", "stop"
READY, FAILED, STEP, REPLY, DEAD = "ready", "failed", "step", "reply", "dead"

_HEADER = struct.Struct("!Q")
CHANNEL_TOKEN_BYTES = 32  # hex characters
CHANNEL_ID_BYTES = 32  # a uuid4's hex
CHANNEL_HELLO_SIZE = CHANNEL_TOKEN_BYTES + CHANNEL_ID_BYTES


def frame(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def channel_step(outputs: list, failures: list, step_report: tuple | None = None) -> bytes:
    """A core's STEP frame to an output channel: the step's outputs there (`RequestOutput.wire()`
    values), the errors of requests sent on it (id, error), and the step's report, if any
    (`replicas.cache_digest.StepReport`, as a plain tuple)."""
    return frame((STEP, outputs, failures, step_report))


def channel_frame(message: list) -> bytes:
    """An ingress's message to a core on its output channel: JSON, never a pickle."""
    body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


def channel_loads(body) -> Any:
    return json.loads(bytes(body))


def channel_add(request_id: str, prompt_token_ids: list[int], prompt: str | None,
                block_hashes: list[int] | None, params: SamplingParams, priority: int) -> bytes:
    return channel_frame([ADD, request_id, prompt_token_ids, prompt, block_hashes,
                          params_to_json(params), priority])


def channel_abort(request_ids: list[str]) -> bytes:
    return channel_frame([ABORT, request_ids])


_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name != "eos_token_ids")


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    """The user's sampling settings as JSON values (the engine fills in the rest)."""
    values = {name: getattr(params, name) for name in _PARAM_FIELDS}
    values["output_kind"] = params.output_kind.value
    if params.logit_bias:  # JSON keys are strings
        values["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.structured_outputs is not None:
        so = params.structured_outputs
        values["structured_outputs"] = {f.name: getattr(so, f.name) for f in fields(so)}
    return values


def params_from_json(values: dict[str, Any]) -> SamplingParams:
    """params_to_json's inverse; a TypeError or ValueError (ParamError) for anything else."""
    if not isinstance(values, dict) or not set(values) <= set(_PARAM_FIELDS):
        raise TypeError("sampling params must be an object of SamplingParams' fields")
    values = dict(values)
    values["output_kind"] = RequestOutputKind(values.get("output_kind", 0))
    if values.get("logit_bias"):
        values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
    if values.get("structured_outputs") is not None:
        values["structured_outputs"] = StructuredOutputsParams(**values["structured_outputs"])
    return SamplingParams(**values)


class CoreRefused(Exception):
    """A request sent on an output channel that the core did not take (`reason`: "full", at its
    `max_ongoing_requests`; or "draining", stopping): the ingress sends it elsewhere."""

    def __init__(self, reason: str):
        super().__init__(f"the engine core refused the request: {reason}")
        self.reason = reason

    def __reduce__(self):
        return (CoreRefused, (self.reason,))


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
    """Bytes in, whole messages out: a frame split across reads waits for its rest. `loads`
    decodes a frame's body (`channel_loads` for what an ingress sends on a channel)."""

    def __init__(self, loads=pickle.loads, max_frame: int | None = None):
        self._buffer = bytearray()
        self._loads = loads
        self._max_frame = max_frame

    def feed(self, data: bytes) -> list[tuple]:
        buffer = self._buffer
        buffer += data
        messages, start, size = [], 0, len(buffer)
        with memoryview(buffer) as view:  # released before the buffer shrinks
            while size - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(view, start)
                if self._max_frame is not None and length > self._max_frame:
                    raise ValueError(f"a frame of {length} bytes is over {self._max_frame}")
                end = start + _HEADER.size + length
                if end > size:
                    break
                messages.append(self._loads(view[start + _HEADER.size:end]))
                start = end
        if start:
            del buffer[:start]
        return messages
