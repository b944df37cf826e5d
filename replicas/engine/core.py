"""The engine core: one replica's engine, stepping in a loop of its own (vLLM V1's EngineCore).

Every serving request reaches a core, and every output leaves it, on the connection of the
ingress replica that sent it (`replicas/engine/core_server.py`, `replicas/engine/protocol.py`). The loop reads
what came (requests, aborts, connections that went away), steps the engine, and sends each
ingress one message with its requests' outputs, the core's queue as of the step (for the
ingress's router) and, about once a second, its routing digest. The replica that started the core
(`replicas/engine/core_process.py`) gets its stats on a link of its own, and nothing of its tokens.

By default the core is a process of its own, whose only Python thread is this loop: in the
replica's process the step would share the GIL with Ray's threads, and on a small model a step is
mostly Python between torch calls. Tensor-parallel replicas run the same loop in a thread of the
replica, where Ray placed their ranks.

    python -m pagedserve.replicas.engine.core FD   # FD: this end of the replica's socket pair
"""
from __future__ import annotations

import gc
import itertools
import logging
import os
import pickle
import select
import socket
import sys
import time
import traceback
from concurrent.futures import Future

from pagedserve.replicas.engine import cpu_binding, protocol
from pagedserve.replicas.core.cache_digest import RoutingReporter, StepReport, step_report
from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.engine.core_server import Client, CoreServer
from pagedserve.replicas.core.errors import StepFailed
from pagedserve.replicas.engine.protocol import Failure
from pagedserve.replicas.core.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# A failed step fails only its own requests; this many failed steps in a row means the engine is
# broken (not one bad batch), and the loop stops so the replica reports unhealthy and is replaced.
MAX_CONSECUTIVE_STEP_FAILURES = 2
# While the engine is busy its stats go to the replica at most this often (its metrics,
# autoscaling stats and stall check read them about once a second); always when it goes idle.
STATS_PERIOD_S = 0.1
# An idle core whose last stats still had load or a prefix working set in them (both fade over
# their windows: `pagedserve.replicas.core.step_load`, `pagedserve.replicas.core.working_set`) sends fresh ones this often until
# they reach zero, so the autoscaler does not read a replica idle for minutes as busy.
IDLE_STATS_PERIOD_S = 1.0
DIGEST_PERIOD_S = 1.0  # the routing digest's period, to every client
ADAPTER_POLL_S = 0.005  # an idle core loading an adapter for LoadAdapter looks this often
PROBE_ID_PREFIX = "readiness-probe-"  # the idle core's own one-token requests
PROBE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)
_READ_SIZE = 1 << 16


def make_engine(config: EngineConfig, engine_class: str | None = None):
    """The engine a core steps: `engine_class`, an encoder's batcher, or an LLMEngine."""
    from pagedserve.replicas.model_files.embedding_model import resolve_model_name, uses_encoder
    if engine_class is not None:
        module, _, name = engine_class.partition(":")
        import importlib
        return getattr(importlib.import_module(module), name)(config)
    if uses_encoder(config.model):
        from pagedserve.replicas.engine.encoder_engine import EncoderEngine, EncoderRequests
        return EncoderRequests(EncoderEngine(config, resolve_model_name(config.model)))
    from pagedserve.replicas.engine.llm_engine import LLMEngine
    return LLMEngine(config)


class EngineCore:
    """`own_process`: the core is a process of its own, which may bind to CPUs of its own (in a
    thread of its replica it shares the replica's)."""

    def __init__(self, start: protocol.Start, own_process: bool = True):
        config = EngineConfig.model_validate(start.config)
        self.config = config
        self.engine = make_engine(config, start.engine_class)
        self.cpus = _bind(config, self.engine) if own_process else []
        self.server = CoreServer(start.host)
        self.max_requests = start.max_requests
        self.probe_interval_s = start.probe_interval_s
        self.routing = RoutingReporter(self)  # runs here: the KV-event log is the block manager's
        self.owners: dict[str, Client] = {}  # request id -> the client that sent it
        self.failures: list[tuple[str, Failure]] = []
        self.adapter_loads: list[tuple[Client, str, Future]] = []  # LoadAdapter, until answered
        self.draining = False
        self.last_generation_time: float | None = None
        self._probe_ids = itertools.count()
        self._last_probe = 0.0
        self._step_failures = 0
        self._stats_due = True
        self._stats_sent_at = 0.0
        self._stats_fading = False  # the last stats sent had load or a working set to fade
        self._sent_busy = False  # the last stats sent showed requests
        self._digest_at = 0.0

    def info(self) -> dict:
        engine = self.engine
        return {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                "block_size": engine.block_size, "vocab_size": _vocab_size(engine),
                "max_logprobs": self.config.max_logprobs,
                "tasks": list(_tasks(engine, self.config)), "pooling": self.config.pooling,
                "reasoning_parser": self.config.reasoning_parser,
                "tokenizer": pickle.dumps(engine.tokenizer), "address": list(self.server.address),
                "stats": self.stats(), "gc_frozen_objects": gc.get_freeze_count()}

    def stats(self) -> dict:
        stats = self.engine.stats()
        return {**stats, "last_generation_time": self.last_generation_time,
                "num_clients": len(self.server.clients),
                "num_queued_at_ingress": self.server.num_queued, "draining": self.draining,
                "engine_cpus": self.cpus}

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, link: socket.socket) -> None:
        """Until the replica says Stop or goes away."""
        reader = protocol.core_reader()
        server = self.server
        while True:
            busy = self.engine.has_unfinished_requests() or self.failures
            timeout = 0.0 if busy else ADAPTER_POLL_S if self.adapter_loads else self._idle_wait_s()
            for sock in select.select([link, *server.sockets()], [], [], timeout)[0]:
                if sock is not link:
                    server.on_readable(sock)
                    continue
                data = link.recv(_READ_SIZE)
                if not data:
                    return
                for message in reader.feed(data):
                    if isinstance(message, protocol.Stop):
                        return
                    if isinstance(message, protocol.Drain):  # the clients route elsewhere now
                        self.draining = self._stats_due = True
                        server.broadcast(protocol.CoreOutputs([], draining=True))
            for request_id in server.take_lost():
                self._abort(request_id)
            for client, message in server.take_received():
                self._handle(client, message)
            if self.adapter_loads:
                self._answer_adapter_loads()
            self._probe_if_due()
            # Stats before the step too: a step that hangs must find the replica knowing the
            # core has work (its stall check reads them).
            self._send_stats(link)
            outputs = self._step() if self.engine.has_unfinished_requests() else []
            self._send(outputs)
            self._send_stats(link)

    def _idle_wait_s(self) -> float:
        waits = [DIGEST_PERIOD_S if self.server.clients else None,
                 IDLE_STATS_PERIOD_S if self._stats_fading else None,
                 self.probe_interval_s / 4 if self.probe_interval_s else None]
        return min((w for w in waits if w is not None), default=None)

    def _handle(self, client: Client, message) -> None:
        self._stats_due = True
        if isinstance(message, protocol.AddRequest):
            self._add(client, message)
        elif isinstance(message, protocol.Abort):
            for request_id in message.request_ids:
                if self.owners.get(request_id) is client:  # its own requests only
                    self._abort(request_id)
        elif isinstance(message, protocol.QueuedHere):
            client.num_queued = max(0, message.num_requests)
        elif isinstance(message, protocol.LoadAdapter):
            try:
                self.adapter_loads.append((client, message.request_id,
                                           self.engine.load_adapter(message.lora)))
            except (ValueError, AttributeError) as exc:  # LoRA off, or an engine without it
                self.server.send(client, protocol.AdapterLoaded(message.request_id, str(exc)))
        elif isinstance(message, protocol.UnloadAdapter) and hasattr(self.engine, "remove_adapter"):
            self.engine.remove_adapter(message.lora_int_id)

    def _answer_adapter_loads(self) -> None:
        waiting = []
        for client, request_id, future in self.adapter_loads:
            if not future.done():
                waiting.append((client, request_id, future))
                continue
            try:
                self.engine.lora.admit(future)
                error = None
            except ValueError as exc:  # the adapter's own problem: the ingress answers 400
                error = str(exc)
            self.server.send(client, protocol.AdapterLoaded(request_id, error))
        self.adapter_loads = waiting

    def _add(self, client: Client, add: protocol.AddRequest) -> None:
        request_id = add.request_id
        if self.draining or (self.max_requests is not None
                             and len(self.owners) >= self.max_requests):
            reason = "draining" if self.draining else "full"
            return self._fail_now(client, Failure(request_id, protocol.REFUSED, reason))
        if request_id in self.owners:
            return self._fail_now(client, Failure(request_id, protocol.INVALID,
                                                  f"request id {request_id!r} is already running"))
        engine = self.engine
        try:
            engine.add(engine.make_request(
                request_id, {"prompt_token_ids": add.prompt_token_ids,
                             "block_hashes": add.block_hashes}, add.params, priority=add.priority,
                lora_request=add.lora))
        except ValueError as exc:
            return self._fail_now(client, Failure(request_id, protocol.INVALID, str(exc),
                                                  getattr(exc, "param", None)))
        self.owners[request_id] = client
        client.requests.add(request_id)

    def _fail_now(self, client: Client, failure: Failure) -> None:
        self.server.send(client, protocol.CoreOutputs([], [failure], draining=self.draining))

    def _abort(self, request_id: str) -> None:
        client = self.owners.pop(request_id, None)
        if client is not None:
            client.requests.discard(request_id)
        self.engine.abort_request(request_id)
        self._stats_due = True

    def _probe_if_due(self) -> None:
        """An idle engine proves it can generate now and then (readiness): a one-token request
        through the same scheduler and cache as any other, whose output nobody reads."""
        if self.probe_interval_s is None:
            return
        now = time.time()
        last = self.last_generation_time
        if (self.engine.has_unfinished_requests() or now - self._last_probe < self.probe_interval_s
                or (last is not None and now - last < self.probe_interval_s)):
            return
        self._last_probe = now
        token = getattr(self.engine.tokenizer, "bos_token_id", None)
        try:
            self.engine.add(self.engine.make_request(f"{PROBE_ID_PREFIX}{next(self._probe_ids)}",
                                                     {"prompt_token_ids": [token or 0]},
                                                     PROBE_PARAMS))
        except ValueError as exc:
            logger.warning("readiness probe failed: %s", exc)

    def _step(self) -> list:
        engine = self.engine
        generated = engine.num_generation_tokens
        try:
            outputs = engine.step()
        except StepFailed as exc:
            self._step_failures += 1
            if self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            self.failures += [(rid, Failure(rid, protocol.STEP_FAILED, str(exc)))
                              for rid in exc.request_ids]
            return []
        self._step_failures = 0
        self._stats_due = True
        if engine.num_generation_tokens > generated:
            self.last_generation_time = time.time()
        self.failures += [(rid, Failure(rid, protocol.INVALID, str(exc), getattr(exc, "param", None)))
                          for rid, exc in engine.take_failures()]
        return outputs

    def _send(self, outputs: list) -> None:
        owners = self.owners
        by_client: dict[Client, tuple[list, list]] = {}
        for output in outputs:
            client = owners.get(output.request_id)
            if client is None:  # a probe's, or aborted meanwhile
                continue
            if output.finished:
                del owners[output.request_id]
                client.requests.discard(output.request_id)
            by_client.setdefault(client, ([], []))[0].append(output)
        if self.failures:
            for request_id, failure in self.failures:
                client = owners.pop(request_id, None)
                if client is not None:
                    client.requests.discard(request_id)
                    by_client.setdefault(client, ([], []))[1].append(failure)
            self.failures = []
        digest = self._digest_if_due()
        if digest is not None:
            for client in self.server.clients.values():
                if client.client_id is not None:
                    by_client.setdefault(client, ([], []))
        if not by_client:
            return
        report = self._step_report()
        for client, (batch, failed) in by_client.items():
            self.server.send(client, protocol.CoreOutputs(batch, failed, report, digest,
                                                          self.draining))

    def _digest_if_due(self) -> dict | None:
        now = time.monotonic()
        joined = self.server.joined
        if not joined and now - self._digest_at < DIGEST_PERIOD_S:
            return None
        self.server.joined = False
        self._digest_at = now
        return self.routing.report(force_snapshot=joined)

    def _step_report(self) -> StepReport:
        engine = self.engine
        if hasattr(engine, "scheduler"):
            return step_report(engine)
        return StepReport(time.time(), len(engine.requests), engine.num_arrived, 0)

    def _send_stats(self, link: socket.socket) -> None:
        now = time.monotonic()
        busy = self.engine.has_unfinished_requests()
        if self._stats_fading and not busy and now - self._stats_sent_at >= IDLE_STATS_PERIOD_S:
            self._stats_due = True
        # While busy, at most every STATS_PERIOD_S; the first stats that show work, at once.
        if not self._stats_due or (busy and self._sent_busy
                                   and now - self._stats_sent_at < STATS_PERIOD_S):
            return
        stats = self.stats()
        self._stats_due, self._stats_sent_at, self._sent_busy = False, now, busy
        self._stats_fading = bool(stats.get("compute_utilization") or stats.get("kv_working_set"))
        link.sendall(protocol.frame(protocol.Stats(stats)))

    def close(self) -> None:
        self.server.close()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self.cpus:
            cpu_binding.release()


def _vocab_size(engine) -> int:
    runner = getattr(engine, "runner", None)
    return runner.vocab_size if runner is not None else engine.vocab_size


def _tasks(engine, config: EngineConfig) -> tuple[str, ...]:
    tasks = getattr(engine, "tasks", None)
    if tasks is not None:
        return tuple(tasks)
    return ("generate", "embed") if config.pooling else ("generate",)


def _bind(config: EngineConfig, engine) -> list[int]:
    """Bind this process to the CPUs config.cpu_bind names (`replicas/engine/cpu_binding.py`); which."""
    runner = getattr(engine, "runner", None)
    if config.cpu_bind == "auto" and (runner is None or runner.device.type != "cpu"):
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


def serve(link: socket.socket, in_process: bool = False) -> int:
    """A core's whole life on the replica's link: Start, Ready (or StartFailed), the loop, and
    Died if the loop fails."""
    reader = protocol.core_reader()
    start = None
    while start is None:
        data = link.recv(_READ_SIZE)
        if not data:
            return 0
        for message in reader.feed(data):
            start = message if isinstance(message, protocol.Start) else start
    try:
        core = EngineCore(start, own_process=not in_process)
    except BaseException as exc:  # noqa: BLE001 - the replica reports why it could not start
        link.sendall(protocol.frame(protocol.StartFailed(f"{type(exc).__name__}: {exc}",
                                                         traceback.format_exc())))
        return 1
    if not in_process:
        # The process as built (the model, its tokenizer, the libraries) lives as long as it
        # does: frozen out of the collector's sight, a full collection while serving walks only
        # what serving made. vLLM's engine core does the same.
        gc.collect()
        gc.freeze()
    try:
        link.sendall(protocol.frame(protocol.Ready(core.info())))
        core.run(link)
    except ConnectionError:  # the replica went away while we sent: nobody is left to tell
        return 0
    except BaseException as exc:  # noqa: BLE001 - a bug or a device failure: the replica dies
        logger.exception("engine core loop died")
        try:
            link.sendall(protocol.frame(protocol.Died(f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass
        return 1
    finally:
        core.close()
    return 0


def main(fd: int) -> int:
    logging.basicConfig(level=logging.WARNING)  # quiet, as the replica's own logs are
    return serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
