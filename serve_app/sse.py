"""A streaming response that writes, in one piece, every chunk its body makes without waiting.

Each write to a client's socket wakes the client, and on loopback the kernel charges the sender
for much of that: a write that wakes an idle reader costs several times the CPU of one that does
not (starlette's `StreamingResponse` writes every chunk, then the end of the body, each on its
own). A stream's last engine output makes its last text event, the event
with its finish reason, the usage event and `data: [DONE]` at once, and the end of the body
follows: here all of that is one write. Nothing waits for company: a chunk is written as soon as
the body would wait for its next one, so no token leaves later than it did.

Whether the body would wait is found by running its next step by hand: a step that finishes
without suspending made its chunk now; one that suspends is then awaited from this task, exactly
as `async for` would have (cancellation reaches the body where it waits, its cleanup runs).
"""
from __future__ import annotations

from starlette.responses import StreamingResponse


class _Suspend:
    """Awaiting it hands `value` (what the body's step suspended on) to the task running us."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return (yield self.value)


async def _resume(step, suspended):
    """Run a step that suspended on `suspended` to its end, from this task; its result."""
    while True:
        try:
            sent = await _Suspend(suspended)
        except BaseException as exc:  # noqa: BLE001 - cancellation: the step gets it where it waits
            try:
                suspended = step.throw(exc)
            except StopIteration as done:
                return done.value
            continue
        try:
            suspended = step.send(sent)
        except StopIteration as done:
            return done.value


class CoalescingStreamingResponse(StreamingResponse):
    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        chunks: list[bytes] = []
        iterator = self.body_iterator.__aiter__()
        while True:
            step = iterator.__anext__()
            try:
                suspended = step.send(None)
            except StopIteration as made:  # made without waiting: it joins the pending ones
                chunks.append(self._encode(made.value))
                continue
            except StopAsyncIteration:
                break
            if chunks:  # the body waits now: what it made meanwhile leaves first
                body, chunks = b"".join(chunks), []
                try:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                except BaseException as exc:
                    _abandon(step, exc)
                    raise
            try:
                chunks.append(self._encode(await _resume(step, suspended)))
            except StopAsyncIteration:
                break
        await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": False})

    def _encode(self, chunk) -> bytes:
        return chunk if isinstance(chunk, bytes) else bytes(chunk) if isinstance(
            chunk, memoryview) else chunk.encode(self.charset)


def _abandon(step, exc: BaseException) -> None:
    """The write failed or was cancelled while the body's step waited: the body gets the same
    error where it waits, so it ends (and cleans up) as it would under `async for`."""
    try:
        step.throw(exc)
    except BaseException:  # noqa: BLE001 - it ended, which is all that is wanted here
        pass


def named_event(kind: str, data: str) -> str:
    """One server-sent event with its `event:` name, as the Responses and Messages APIs send
    them; `data` is the event's JSON."""
    return f"event: {kind}\ndata: {data}\n\n"
