"""CoalescingStreamingResponse: what the body makes without waiting leaves in one write, nothing
waits for company, and a stream cut short still ends its body where it waits."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.serve_app.sse import CoalescingStreamingResponse

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}


async def _never():
    await asyncio.Event().wait()


def _run(body, send=None):
    sent = []

    async def record(message):
        sent.append((message["type"], message.get("body"), message.get("more_body")))
        if send is not None:
            await send(message)

    async def main():
        response = CoalescingStreamingResponse(body, media_type="text/event-stream")
        await response(SCOPE, _never, record)

    asyncio.run(main())
    return sent


def test_chunks_made_together_leave_together_and_the_end_rides_on_the_last():
    async def body():
        yield "data: 1\n\n"
        yield "data: 2\n\n"
        await asyncio.sleep(0.001)
        yield b"data: 3\n\n"
        await asyncio.sleep(0)  # a bare yield to the loop is a wait too
        yield "data: 4\n\n"
        yield "data: [DONE]\n\n"

    assert _run(body()) == [
        ("http.response.start", None, None),
        ("http.response.body", b"data: 1\n\ndata: 2\n\n", True),
        ("http.response.body", b"data: 3\n\n", True),
        ("http.response.body", b"data: 4\n\ndata: [DONE]\n\n", False),
    ]


def test_a_chunk_is_written_before_the_body_waits_for_the_next():
    """The first chunk must be on the wire while the body still waits: no chunk is held back for
    one that has not been made."""
    release = None
    seen_while_waiting = []
    written = []

    async def body():
        nonlocal release
        yield "first"
        release = asyncio.Event()
        await release.wait()
        yield "second"

    async def send(message):
        written.append(message.get("body"))

    async def main():
        response = CoalescingStreamingResponse(body(), media_type="text/event-stream")
        task = asyncio.create_task(response(SCOPE, _never, send))
        while release is None:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        seen_while_waiting.extend(written)
        release.set()
        await task

    asyncio.run(main())
    assert seen_while_waiting == [None, b"first"]
    assert written == [None, b"first", b"second"]


def test_an_empty_body_still_ends_the_response():
    async def body():
        return
        yield  # pragma: no cover

    assert _run(body()) == [("http.response.start", None, None),
                            ("http.response.body", b"", False)]


@pytest.mark.parametrize("where", ["waiting for the body", "writing"])
def test_cancelled_streams_end_their_body_where_it_waits(where):
    """A client that goes away cancels the response; the body gets the cancellation at its await
    (its cleanup, which aborts the request in the engine, runs) as under `async for`."""
    cleaned = []

    async def main():
        waiting = asyncio.Event()
        write_blocks = asyncio.Event()

        async def body():
            try:
                yield "made"
                waiting.set()
                await asyncio.Event().wait()
                yield "never"
            finally:
                cleaned.append(True)

        async def send(message):
            if where == "writing" and message.get("body") == b"made":
                write_blocks.set()
                await asyncio.Event().wait()

        response = CoalescingStreamingResponse(body(), media_type="text/event-stream")
        task = asyncio.create_task(response(SCOPE, _never, send))
        await (write_blocks if where == "writing" else waiting).wait()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cleaned == [True]


def test_an_error_of_the_body_propagates():
    async def body():
        yield "ok"
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _run(body())
