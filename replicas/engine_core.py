"""The engine core: one replica's LLMEngine stepping in a process of its own (vLLM V1's EngineCore).

In the replica's own process the step thread shares the GIL with Ray Serve's event loop, and on a
small model a step is mostly Python between torch calls, so the two ping-pong the GIL: measured,
that cost the step thread ~60 µs per streamed token, more than the engine itself. Here the loop is
the only Python thread: it reads what the replica sent (new requests, aborts, calls), steps, and
sends every output of the step back as one message (`replicas/core_wire.py`), with the engine's
stats when they are due. The replica's end is `replicas/engine_core_client.py`. Ingress replicas
may connect here too (`replicas/core_channels.py`): the outputs of their requests then go
straight to them, and the replica hears only that those requests finished.

    python -m replicas.engine_core FD   # FD: this end of the socket pair; the config arrives on it

The process ends when its socket closes (the replica is gone) or on `STOP`.
"""
from __future__ import annotations

import gc
import logging
import os
import select
import socket
import sys
import time
import traceback

from replicas import core_wire as wire
from replicas import cpu_binding
from replicas.cache_digest import RoutingReporter, StepReport, step_report
from replicas.config import EngineConfig
from replicas.core_channels import CoreChannels
from replicas.engine_client import MAX_CONSECUTIVE_STEP_FAILURES
from replicas.errors import StepFailed
from replicas.output_channel import ChannelClosed
from replicas.sampling_params import ParamError

logger = logging.getLogger(__name__)

# While the engine is busy its stats ride along at most this often (the replica's routing,
# autoscaling, metrics and stall checks read them about once a second); always when it goes idle.
STATS_PERIOD_S = 0.05
# An idle core whose last stats still had load or a prefix working set in them (both fade over
# their windows: `replicas.step_load`, `replicas.working_set`) sends fresh ones this often until
# they reach zero, so the autoscaler does not read a replica idle for minutes as busy.
IDLE_STATS_PERIOD_S = 1.0
_READ_SIZE = 1 << 20


class _Socket:
    """The core's end: blocking sends (the replica always reads), reads that never wait while
    the engine has work."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = wire.FrameReader()
        self.lost: list[str] = []  # requests whose output channel went away

    def send(self, message: tuple) -> None:
        self.sock.sendall(wire.frame(message))

    def receive(self, wait: bool, channels: CoreChannels | None = None,
                wait_s: float | None = None) -> list[tuple] | None:
        """Every whole message that has arrived (waiting for one if `wait`, at most wait_s
        seconds if given); None once the replica has closed its end. Output channels'
        connections are served meanwhile; a subscriber that went away ends the wait (its
        requests have errors to report)."""
        messages: list[tuple] = []
        timeout = wait_s if wait else 0.0
        while True:
            watched = [self.sock, *channels.sockets()] if channels is not None else [self.sock]
            readable = select.select(watched, [], [], timeout)[0]
            if not readable:
                return messages
            for sock in readable:
                if sock is not self.sock:
                    self.lost += channels.on_readable(sock)
                    if self.lost or channels.changed or channels.received or channels.abandoned:
                        timeout = 0.0  # requests to take, errors to send, or stats
                    continue
                try:
                    data = self.sock.recv(_READ_SIZE)
                except ConnectionError:  # the replica went away mid-message
                    return None
                if not data:
                    return None
                messages += self.reader.feed(data)
                if messages:
                    timeout = 0.0  # drain what else is there, then go


class EngineCore:
    def __init__(self, config: EngineConfig):
        from replicas.engine import LLMEngine
        self.engine = LLMEngine(config)
        self.engine.wire_outputs = True  # sent as they are (`RequestOutput.wire()` values)
        self.cpus = _bind(config, self.engine)
        self.last_generation_time: float | None = None
        self._held: dict[str, tuple] = {}  # ADDs from the replica past max_ongoing_requests
        self._intake_time = time.time()  # when the loop last took in what was sent to it
        self.routing = RoutingReporter(self)  # runs here: the KV-event log is the block manager's
        self._errors: list[tuple[str, BaseException]] = []
        self._failures = 0
        self._stats_due = True
        self._stats_sent_at = 0.0
        self._stats_fading = False  # the last stats sent had load or a working set to fade
        self.channels: CoreChannels | None = None  # after the replica asks (open_channels)
        # Requests on an output channel are taken while fewer than this are held (the replica's
        # max_ongoing_requests, which Ray applies to the calls); none while draining.
        self.max_ongoing_requests: int | None = None
        self.draining = False

    def info(self) -> dict:
        import pickle
        engine = self.engine
        return {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                "block_size": engine.block_size, "vocab_size": engine.runner.vocab_size,
                "tokenizer": pickle.dumps(engine.tokenizer), "stats": self.stats(),
                "gc_frozen_objects": gc.get_freeze_count()}

    def stats(self) -> dict:
        channels = self.channels
        stats = self.engine.stats()
        if self._held:  # they wait, here rather than in the engine
            stats["num_waiting"] += len(self._held)
            stats["num_requests"] += len(self._held)
        return {**stats, "last_generation_time": self.last_generation_time,
                "core_channels": channels.num_subscribers if channels else 0,
                "core_channel_outputs": channels.num_outputs if channels else 0,
                "core_channel_requests": channels.num_requests if channels else 0,
                "engine_cpus": self.cpus}

    def _step_report(self) -> StepReport:
        # As of the intake before the step: a request an ingress sent during the step waits in
        # the socket, out of the count, and must read as sent after the report.
        return step_report(self.engine, len(self._held), now=self._intake_time)

    # -- calls the replica makes -----------------------------------------------------------------
    def call_routing_report(self, force_snapshot: bool = False) -> dict:
        return self.routing.report(force_snapshot=force_snapshot)

    def call_open_channels(self, host: str, max_ongoing_requests: int | None = None
                           ) -> tuple[str, int, str]:
        """Listen for ingress replicas' output channels on host; (host, port, token)."""
        if self.channels is None:
            self.channels = CoreChannels(host)
        self.max_ongoing_requests = max_ongoing_requests
        return self.channels.address

    def call_set_max_ongoing_requests(self, max_ongoing_requests: int | None) -> None:
        self.max_ongoing_requests = max_ongoing_requests

    def call_drain(self) -> None:
        """Take no more requests on the output channels (the replica is stopping); those held
        run to their end."""
        self.draining = True

    # -- the loop --------------------------------------------------------------------------------
    def run(self, conn: _Socket) -> None:
        engine = self.engine
        while True:
            idle = not (engine.has_unfinished_requests() or self._errors or self._held)
            messages = conn.receive(wait=idle, channels=self.channels,
                                    wait_s=IDLE_STATS_PERIOD_S if self._stats_fading else None)
            self._intake_time = time.time()  # what came before this is in the engine's count
            if messages is None:
                return
            if idle and self._stats_fading:
                self._stats_due = True
            if conn.lost:
                self._lose(conn.lost)
                conn.lost = []
            if self.channels is not None:
                self._serve_channels(self.channels)
            for message in messages:
                if message[0] == wire.STOP:
                    return
                self._handle(conn, message)
            self._admit_held()
            outputs = self._step() if engine.has_unfinished_requests() else []
            self._send_step(conn, outputs)

    def _handle(self, conn: _Socket, message: tuple) -> None:
        kind = message[0]
        self._stats_due = True
        if kind == wire.ADD:
            if self._held or self._full():
                # Its Ray call keeps its slot meanwhile, so Ray queues the calls after it.
                self._held[message[1]] = message
            else:
                self._add(message)
        elif kind == wire.ABORT:
            for request_id in message[1]:
                self._held.pop(request_id, None)
                self.engine.abort_request(request_id)
                if self.channels is not None:
                    self.channels.forget(request_id)
        elif kind == wire.CALL:
            _, call_id, name, kwargs = message
            try:
                reply = (wire.REPLY, call_id, True, getattr(self, f"call_{name}")(**kwargs))
            except Exception as exc:  # noqa: BLE001 - the caller gets the error, the core goes on
                reply = (wire.REPLY, call_id, False, wire.portable(exc))
            conn.send(reply)
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _full(self, waiting: int = 0) -> bool:
        """Whether the core holds its replica's max_ongoing_requests (with `waiting` more)."""
        limit = self.max_ongoing_requests
        return limit is not None and len(self.engine.requests) + waiting >= limit

    def _add(self, message: tuple) -> None:
        _, request_id, prompt, params, priority, channel_id = message
        try:
            self.engine.add(self.engine.make_request(request_id, prompt, params,
                                                     priority=priority))
        except ValueError as exc:
            self._errors.append((request_id, exc))
            return
        if self.channels is not None:
            self.channels.route(request_id, channel_id)

    def _admit_held(self) -> None:
        """Requests that came by Ray while the core was full, in order, as room frees."""
        while self._held and not self._full():
            self._add(self._held.pop(next(iter(self._held))))

    def _serve_channels(self, channels: CoreChannels) -> None:
        """What the ingresses sent on their channels: requests to take, aborts, and those whose
        channel went away."""
        for request_id in channels.take_abandoned():
            self.engine.abort_request(request_id)
            self._stats_due = True
        for channel_id, message in channels.take_received():
            self._stats_due = True
            kind = message[0] if isinstance(message, list) and message else None
            if kind == wire.ADD and len(message) == 7 and isinstance(message[1], str):
                self._add_from(channels, channel_id, *message[1:])
            elif kind == wire.ABORT and len(message) == 2 and isinstance(message[1], list):
                for request_id in message[1]:
                    if channels.sent_by(request_id, channel_id):  # its own requests only
                        self.engine.abort_request(request_id)
                        channels.forget(request_id)
            else:
                logger.debug("an output channel sent an unknown message; ignored")
        if channels.changed:
            channels.changed, self._stats_due = False, True

    def _add_from(self, channels: CoreChannels, channel_id: str, request_id: str,
                  prompt_token_ids, prompt, block_hashes, params, priority) -> None:
        error = self._take(request_id, prompt_token_ids, prompt, block_hashes, params, priority)
        if error is not None:
            self._lose(channels.refuse(channel_id, request_id, error))
        else:
            channels.accept(request_id, channel_id)

    def _take(self, request_id: str, prompt_token_ids, prompt, block_hashes, params,
              priority) -> BaseException | None:
        """Take a request sent on a channel into the engine: None, or the error saying why not."""
        engine = self.engine
        if self.draining:
            return wire.CoreRefused("draining")
        if self._full(waiting=len(self._held)):  # those Ray sent first go first
            return wire.CoreRefused("full")
        if request_id in engine.requests:
            return ValueError(f"request id {request_id!r} is already running")
        try:
            params = wire.params_from_json(params)
            if not isinstance(priority, int):
                raise ParamError("priority", "priority must be an integer")
            if not (_ints(prompt_token_ids) and (block_hashes is None or _ints(block_hashes))):
                raise ParamError("prompt", "prompt token ids and block hashes must be integers")
            engine.add(engine.make_request(
                request_id, {"prompt": prompt, "prompt_token_ids": prompt_token_ids,
                             "block_hashes": block_hashes}, params, priority=priority))
        except (ValueError, TypeError) as exc:  # a TypeError: a request no ingress of ours sends
            return exc if isinstance(exc, ValueError) else ValueError(f"bad request: {exc}")
        return None

    def _step(self) -> list:
        engine = self.engine
        generated = engine.num_generation_tokens
        try:
            outputs = engine.step()
        except StepFailed as exc:
            self._failures += 1
            if self._failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            self._errors += [(request_id, exc) for request_id in exc.request_ids]
            return []
        self._failures = 0
        self._stats_due = True
        if engine.num_generation_tokens > generated:
            self.last_generation_time = time.time()
        self._errors += engine.take_failures()
        return outputs

    def _lose(self, request_ids: list[str]) -> None:
        """Requests whose output channel went away: nobody reads them; their calls fail."""
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            self._errors.append((request_id, ChannelClosed("the output channel to the ingress "
                                                           "closed")))

    def _send_step(self, conn: _Socket, outputs: list) -> None:
        done: list[str] = []
        if self.channels is not None:
            errors, self._errors = self._errors, []
            outputs, self._errors, done, lost = self.channels.send(outputs, errors,
                                                                   self._step_report)
            self._lose(lost)
        now = time.monotonic()
        stats = None
        if self._stats_due and (not self.engine.has_unfinished_requests()
                                or now - self._stats_sent_at >= STATS_PERIOD_S):
            stats, self._stats_due, self._stats_sent_at = self.stats(), False, now
            self._stats_fading = bool(stats.get("compute_utilization")
                                      or stats.get("kv_working_set"))
        if outputs or self._errors or stats is not None or done:
            errors, self._errors = self._errors, []
            conn.send((wire.STEP, outputs,
                       [(request_id, wire.portable(exc)) for request_id, exc in errors], stats,
                       done))


def _ints(values) -> bool:
    return isinstance(values, list) and all(type(v) is int for v in values)


def _bind(config: EngineConfig, engine) -> list[int]:
    """Bind this process to the CPUs config.cpu_bind names (`replicas/cpu_binding.py`); which."""
    if config.cpu_bind == "auto" and engine.runner.device.type != "cpu":
        return []
    import torch
    try:
        cpus = cpu_binding.claim(config.cpu_bind, torch.get_num_threads())
    except OSError as exc:  # the node's claims cannot be read: run unbound rather than not at all
        logger.warning("engine core not bound to CPUs: %s", exc)
        return []
    if cpus:
        cpu_binding.bind(cpus)
        logger.info("engine core %d bound to CPUs %s", os.getpid(), cpus)
    return cpus


def main(fd: int) -> int:
    logging.basicConfig(level=logging.WARNING)  # quiet, as the replica's own logs are
    conn = _Socket(socket.socket(fileno=fd))
    messages: list[tuple] | None = []
    while messages is not None and not messages:
        messages = conn.receive(wait=True)
    if not messages:
        return 0
    try:
        core = EngineCore(EngineConfig.model_validate(messages[0]))
    except BaseException as exc:  # noqa: BLE001 - the replica reports why it could not start
        conn.send((wire.FAILED, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return 1
    # The process as built (the model, its tokenizer, the libraries: ~310,000 objects with the
    # default model) lives as long as it does. Frozen out of the collector's sight, a full
    # collection while serving walks only what serving made, not all of that (~145 ms, in the
    # middle of a step). vLLM's engine core does the same, and Ray Serve does it for the
    # replica and ingress processes at the end of their start.
    gc.collect()
    gc.freeze()
    conn.send((wire.READY, core.info()))
    try:
        core.run(conn)
    except ConnectionError:  # the replica went away while we sent: nobody is left to tell
        return 0
    except BaseException as exc:  # noqa: BLE001 - a bug or a device failure: the replica dies
        logger.exception("engine core loop died")
        try:
            conn.send((wire.DEAD, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return 1
    finally:
        if core.cpus:
            cpu_binding.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
