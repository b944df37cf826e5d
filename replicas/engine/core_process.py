"""CoreProcess: an engine replica's hold on its engine core (`replicas/engine/core.py`).

The replica starts the core (a process of its own, `python -m pagedserve.replicas.engine.core`, or a thread of
the replica under tensor parallelism), waits for it to be ready, and from then on only listens:
the core's stats arrive on their link, read by the event loop itself (no thread of ours competes
for the GIL); a core that dies, or exits, is seen at once. Tokens never cross this link: the
ingresses connect to the core's own address (`info["address"]`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from pagedserve.replicas.engine import protocol

logger = logging.getLogger(__name__)

# Model load (a first conversion of the default model included) happens before Ready.
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 5.0
DRAIN_POLL_S = 0.05
_READ_SIZE = 1 << 20


class EngineDeadError(RuntimeError):
    pass


class CoreProcess:
    def __init__(self, start: protocol.Start, in_process: bool = False,
                 start_timeout_s: float = START_TIMEOUT_S):
        self._reader = protocol.client_reader()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sock, self._process, self._thread = _start(start, in_process)
        self._finalizer = weakref.finalize(self, _stop, self.sock, self._process, self._thread, 0.0)
        try:
            info = self._await_ready(start_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        self.info = info
        self.address: tuple[str, int, str] = tuple(info["address"])
        self.stats: dict = info["stats"]
        self.sock.setblocking(False)

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None else os.getpid()

    def tokenizer(self):
        return pickle.loads(self.info["tokenizer"])

    def attach(self) -> None:
        """Listen to the core on the running event loop."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def is_healthy(self) -> bool:
        if self.error is not None:
            return False
        if self._process is not None:
            return self._process.poll() is None
        return self._thread.is_alive()

    def check_health(self) -> None:
        if not self.is_healthy():
            raise self.error or EngineDeadError("the engine core has stopped")

    async def drain(self, timeout_s: float) -> bool:
        """Take no new requests and wait, at most timeout_s, until the core holds none; whether
        it got there."""
        self._send(protocol.Drain())
        deadline = time.monotonic() + timeout_s
        await asyncio.sleep(DRAIN_POLL_S)  # the Drain's stats
        while self.is_healthy() and (self.stats.get("num_requests", 0)
                                     or not self.stats.get("draining")):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    def shutdown(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
        self._finalizer.detach()
        _stop(self.sock, self._process, self._thread, STOP_TIMEOUT_S)
        self.error = self.error or EngineDeadError("the engine core was shut down")

    # -- the link -----------------------------------------------------------------------------
    def _send(self, message) -> None:
        try:
            self.sock.sendall(protocol.frame(message))
        except OSError as exc:
            self._die(EngineDeadError(f"the engine core is gone: {exc}"))

    def _await_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.is_healthy():
                raise RuntimeError("the engine core exited before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine core was not ready within {timeout_s:.0f} s")
            if not select.select([self.sock], [], [], 0.5)[0]:
                continue
            data = self.sock.recv(_READ_SIZE)
            if not data:
                continue  # closed: the exit comes next
            for message in self._reader.feed(data):
                if isinstance(message, protocol.Ready):
                    return message.info
                if isinstance(message, protocol.StartFailed):
                    logger.debug("engine core failed to start:\n%s", message.traceback)
                    raise RuntimeError(f"the engine failed to start: {message.message}")

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(_READ_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._loop.remove_reader(self.sock.fileno())
            return self._die(EngineDeadError(f"the engine core is gone: {exc}"))
        if not data:
            self._loop.remove_reader(self.sock.fileno())
            code = self._process.poll() if self._process is not None else None
            return self._die(EngineDeadError(f"the engine core exited (code {code})"))
        for message in self._reader.feed(data):
            if isinstance(message, protocol.Stats):
                self.stats = message.stats
            elif isinstance(message, protocol.Died):
                self._die(EngineDeadError(f"the engine loop died: {message.message}"))

    def _die(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            logger.error("engine core: %s", error)


def child_environ() -> dict[str, str]:
    """This process's environment, with the copy of pagedserve it runs first on PYTHONPATH: a
    `python -m pagedserve...` child then runs the same code, installed or not."""
    import pagedserve
    root = str(Path(pagedserve.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}


def _start(start: protocol.Start, in_process: bool
           ) -> tuple[socket.socket, subprocess.Popen | None, threading.Thread | None]:
    ours, theirs = socket.socketpair()
    process = thread = None
    if in_process:
        from pagedserve.replicas.engine.core import serve
        thread = threading.Thread(target=serve, args=(theirs, True), name="engine-core",
                                  daemon=True)
        thread.start()
    else:
        # `python -m`, not multiprocessing's spawn: it never re-imports the caller's __main__
        # (Ray's worker script, a notebook).
        process = subprocess.Popen([sys.executable, "-m", "pagedserve.replicas.engine.core",
                                    str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                   env=child_environ())
        theirs.close()
    ours.sendall(protocol.frame(start))
    return ours, process, thread


def _stop(sock: socket.socket, process: subprocess.Popen | None, thread: threading.Thread | None,
          timeout_s: float) -> None:
    try:
        sock.setblocking(True)
        sock.settimeout(1.0)
        sock.sendall(protocol.frame(protocol.Stop()))
    except OSError:
        pass
    if thread is not None:
        thread.join(timeout_s)
    sock.close()  # the core also ends on EOF
    if process is not None:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
