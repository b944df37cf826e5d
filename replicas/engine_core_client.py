"""EngineCoreClient: an EngineClient whose engine steps in a process of its own.

The replica's process keeps Ray Serve, the output channels, health and metrics; the engine core
(`replicas/engine_core.py`, started here as `python -m replicas.engine_core`) owns the model, the
KV cache and the scheduler. Both ends talk over one Unix socket pair: requests and aborts go as
they come, outputs come back one message per engine step, read by the event loop itself (no
thread of ours in this process competes for the GIL). The engine's stats arrive with the steps, so
`stats()` stays a plain call; the routing report, which must read the block manager's KV-event
log, is a call to the core.

A core that exits, or whose loop dies, fails every request it held with EngineDeadError and the
replica reports itself unhealthy, as an in-process engine loop does.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

from replicas import core_wire as wire
from replicas.config import EngineConfig
from replicas.engine_client import EngineClient, EngineDeadError, OnOutput
from replicas.outputs import RequestOutput
from replicas.request import PromptInput
from replicas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Model load (a first conversion of the default model included) happens before READY.
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 5.0
DRAIN_POLL_S = 0.05
_READ_SIZE = 1 << 20


class DeliveredOnChannel(Exception):
    """The end of a request whose outputs went straight to its ingress's output channel: the
    replica's call ends (an exception only so that it ends `generate()` like an error would)."""

    def __reduce__(self):
        return (DeliveredOnChannel, ())


class EngineCoreClient(EngineClient):
    core_module = "replicas.engine_core"  # what runs in the core's process (`python -m`)

    def __init__(self, config: EngineConfig, *, start_timeout_s: float = START_TIMEOUT_S):
        self.config = config
        self._receivers: dict[str, OnOutput] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._error: BaseException | None = None
        self._reader = wire.FrameReader()
        self._unsent = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock, self._process = _start(config, self.core_module)
        self._finalizer = weakref.finalize(self, _stop, self._sock, self._process, 0.0)
        try:
            info = self._await_ready(start_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self.block_size = info["block_size"]
        self.vocab_size = info["vocab_size"]
        self.tokenizer = pickle.loads(info["tokenizer"])
        self._stats = info["stats"]
        self.gc_frozen_objects = info["gc_frozen_objects"]  # the core's startup heap (see main)
        self._sock.setblocking(False)
        try:  # a replica builds it on its event loop: hear a core that dies while idle
            asyncio.get_running_loop()
            self._attach()
        except RuntimeError:
            pass  # attached on first use

    # -- EngineClient ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None,
                    on_output: OnOutput, priority: int = 0, channel_id: str | None = None) -> None:
        """Queue a request; a bad one reaches `on_output` as its ValueError (the core checks it).
        With `channel_id`, where that ingress's output channel is connected to the core, the
        outputs go there and `on_output` hears only the end (`DeliveredOnChannel`)."""
        self._check_alive()
        if request_id in self._receivers:
            raise ValueError(f"request id {request_id!r} is already running")
        self._receivers[request_id] = on_output
        self._send((wire.ADD, request_id, prompt, params or SamplingParams(), priority, channel_id))

    async def open_channels(self, host: str, max_ongoing_requests: int | None = None
                            ) -> tuple[str, int, str]:
        """Have the core take ingress replicas' output channels on host (`core_channels.py`),
        and the requests sent on them while it holds fewer than max_ongoing_requests;
        (host, port, token), for the ingress replicas."""
        return tuple(await self._call("open_channels", host=host,
                                      max_ongoing_requests=max_ongoing_requests))

    async def set_max_ongoing_requests(self, max_ongoing_requests: int | None) -> None:
        await self._call("set_max_ongoing_requests", max_ongoing_requests=max_ongoing_requests)

    async def drain(self, timeout_s: float) -> bool:
        """Take no more requests on the output channels and wait, at most timeout_s, until the
        core holds none; whether it got there."""
        await self._call("drain")
        deadline = time.monotonic() + timeout_s
        # The core's stats come with every step at most STATS_PERIOD_S apart, and when it idles.
        while self.is_healthy() and self._stats.get("num_requests", 0):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    def abort_nowait(self, request_id: str) -> None:
        if self._receivers.pop(request_id, None) is not None and self._error is None:
            self._send((wire.ABORT, [request_id]))

    def stats(self) -> dict:
        """The core's stats as of its last message (at most a step or STATS_PERIOD_S old)."""
        return {**self._stats, "healthy": self.is_healthy(), "engine_pid": self._process.pid}

    @property
    def last_generation_time(self) -> float | None:
        return self._stats.get("last_generation_time")

    async def routing_report(self, force_snapshot: bool = False) -> dict:
        """`cache_digest.RoutingReporter.report`, run in the core (it reads the KV-event log)."""
        return await self._call("routing_report", force_snapshot=force_snapshot)

    def is_healthy(self) -> bool:
        return self._error is None and self._process.poll() is None

    async def check_health(self) -> None:
        self._check_alive()

    def shutdown(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        self._finalizer.detach()
        _stop(self._sock, self._process, STOP_TIMEOUT_S)
        self._die(EngineDeadError("the engine core was shut down"), quiet=True)

    # -- the socket -----------------------------------------------------------------------------
    def _await_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"the engine core exited with code {self._process.returncode} "
                                   "before it was ready")
            if time.monotonic() > deadline:
                _stop(self._sock, self._process, 0.0)
                raise TimeoutError(f"the engine core was not ready within {timeout_s:.0f} s")
            if not select.select([self._sock], [], [], 0.5)[0]:
                continue
            data = self._sock.recv(_READ_SIZE)
            if not data:
                continue  # closed: the exit code comes next
            for message in self._reader.feed(data):
                if message[0] == wire.READY:
                    return message[1]
                if message[0] == wire.FAILED:
                    logger.debug("engine core failed to start:\n%s", message[2])
                    raise RuntimeError(f"the engine failed to start: {message[1]}")

    def _attach(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def _send(self, message: tuple) -> None:
        self._attach()
        data = wire.frame(message)
        if not self._unsent:
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._die(EngineDeadError(f"the engine core is gone: {exc}"))
                return
            if sent == len(data):
                return
            data = data[sent:]
            self._loop.add_writer(self._sock.fileno(), self._flush)
        self._unsent += data

    def _flush(self) -> None:
        try:
            sent = self._sock.send(self._unsent)
        except BlockingIOError:
            return
        except OSError as exc:
            self._die(EngineDeadError(f"the engine core is gone: {exc}"))
            return
        del self._unsent[:sent]
        if not self._unsent:
            self._loop.remove_writer(self._sock.fileno())

    def _on_readable(self) -> None:
        messages = []
        try:
            while True:
                data = self._sock.recv(_READ_SIZE)
                if not data:
                    self._closed()
                    break
                messages += self._reader.feed(data)
                if len(data) < _READ_SIZE:
                    break
        except BlockingIOError:
            pass
        except OSError as exc:
            self._die(EngineDeadError(f"the engine core is gone: {exc}"))
        for message in messages:
            self._dispatch(message)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == wire.STEP:
            _, outputs, errors, stats, done = message
            receivers = self._receivers
            for values in outputs:
                output = RequestOutput.from_wire(values)
                receiver = (receivers.pop(output.request_id, None) if output.finished
                            else receivers.get(output.request_id))
                if receiver is not None:
                    receiver(output)
            for request_id, exc in errors:
                receiver = receivers.pop(request_id, None)
                if receiver is not None:
                    receiver(exc)
            for request_id in done:
                receiver = receivers.pop(request_id, None)
                if receiver is not None:
                    receiver(DeliveredOnChannel())
            if stats is not None:
                self._stats = stats
        elif kind == wire.REPLY:
            _, call_id, ok, value = message
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(value) if ok else future.set_exception(value)
        elif kind == wire.DEAD:
            self._die(EngineDeadError(f"the engine loop died: {message[1]}"))

    async def _call(self, name: str, **kwargs):
        self._check_alive()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send((wire.CALL, call_id, name, kwargs))
        return await future

    # -- failure --------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error

    def _closed(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        code = self._process.poll()
        self._die(EngineDeadError(f"the engine core exited (code {code})"))

    def _die(self, error: BaseException, quiet: bool = False) -> None:
        if self._error is None:
            self._error = error
            if not quiet:
                logger.error("engine core: %s", error)
        receivers, self._receivers = self._receivers, {}
        for receiver in receivers.values():
            receiver(self._error)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(self._error)


def _start(config: EngineConfig, module: str) -> tuple[socket.socket, subprocess.Popen]:
    # `python -m`, not multiprocessing's spawn: it never re-imports the caller's __main__ (Ray's
    # worker script, a notebook).
    ours, theirs = socket.socketpair()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())],
                               pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    ours.sendall(wire.frame(config.model_dump()))
    return ours, process


def _stop(sock: socket.socket, process: subprocess.Popen, timeout_s: float) -> None:
    try:
        sock.setblocking(True)
        sock.settimeout(1.0)
        sock.sendall(wire.frame((wire.STOP,)))
    except OSError:
        pass
    sock.close()  # the core also ends on EOF
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
