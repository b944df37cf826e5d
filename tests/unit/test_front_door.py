"""HTTPFrontDoor's parts without Ray: the shared listening port, its request limit, the settings
that turn it on."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from bench.common import free_port
from pagedserve.serve_app.config import ServeSettings
from pagedserve.serve_app.front_door import HTTPFrontDoor, listening_socket


def test_ingress_replicas_share_the_port():
    port = free_port()
    first, second = listening_socket("127.0.0.1", port), listening_socket("127.0.0.1", port)
    first.close()
    second.close()


def test_a_port_held_without_reuseport_is_a_clear_error():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{port}.*direct_http=false"):
            listening_socket("127.0.0.1", port)
    finally:
        holder.close()


def run_asgi(door, path: str) -> list[dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(door({"type": "http", "path": path, "method": "GET", "headers": []}, receive, send))
    return sent


def test_past_max_ongoing_it_answers_503_with_retry_after_and_counts_back_down():
    entered = []

    async def app(scope, receive, send):
        entered.append(door.ongoing)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    door = HTTPFrontDoor(app, "127.0.0.1", 0, max_ongoing=1, retry_after_s=3, door_id="a")
    assert run_asgi(door, "/v1/models")[0]["status"] == 200
    assert entered == [1] and door.ongoing == 0
    door.ongoing = 1  # one request in flight: the next is refused, probes are not
    refused = run_asgi(door, "/v1/completions")
    assert refused[0]["status"] == 503
    assert (b"retry-after", b"3") in refused[0]["headers"]
    assert json.loads(refused[1]["body"])["error"]["code"] == "service_unavailable"
    assert run_asgi(door, "/health")[0]["status"] == 200


def test_direct_http_gives_the_ingress_its_address():
    direct = ServeSettings.from_args({"direct_http": "true", "port": "9123", "host": "0.0.0.0"})
    assert (direct.ingress_settings().http_host, direct.ingress_settings().http_port) == \
        ("0.0.0.0", 9123)
    for args in ({}, {"direct_http": "false"}):  # None: Serve's proxy unless pagedserve starts it
        assert ServeSettings.from_args(args).ingress_settings().http_port is None


async def _serving(door_id: str, port: int) -> HTTPFrontDoor:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": door_id.encode()})

    door = HTTPFrontDoor(app, "127.0.0.1", port, max_ongoing=8, retry_after_s=1, door_id=door_id)
    await door.start()
    return door


def test_a_port_is_shared_by_one_application_only():
    import httpx

    async def scenario():
        port = free_port()
        first = await _serving("app-a", port)
        sibling = await _serving("app-a", port)  # another replica of the same application
        with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{port}: another pagedserve "
                                               r"application \(app-a\) listens there"):
            await _serving("app-b", port)
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/v1/models")).text == "app-a"
        await first.drain(5, lambda: None)
        await sibling.drain(5, lambda: None)
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.ConnectError):  # drained: the port is closed
                await client.get(f"http://127.0.0.1:{port}/v1/models")

    asyncio.run(scenario())


def test_a_port_served_by_another_program_is_refused():
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import threading

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match="another server listens there"):
            asyncio.run(_serving("app-a", other.server_address[1]))
    finally:
        other.shutdown()


def test_a_drain_that_runs_out_of_time_ends_the_open_streams_first():
    import httpx

    async def scenario():
        ended = asyncio.Event()

        async def app(scope, receive, send):  # a stream that lasts until it is told to end
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await ended.wait()
            await send({"type": "http.response.body", "body": b"data: end\n\n"})

        port = free_port()
        door = HTTPFrontDoor(app, "127.0.0.1", port, max_ongoing=8, retry_after_s=1,
                             door_id="a")
        await door.start()
        async with httpx.AsyncClient() as client:
            async with client.stream("GET", f"http://127.0.0.1:{port}/v1/completions") as r:
                lines = r.aiter_lines()
                assert await anext(lines) == "data: 1"
                drain = asyncio.create_task(door.drain(0.2, ended.set))
                rest = [line async for line in lines]
        await drain
        assert ended.is_set() and "data: end" in rest

    asyncio.run(scenario())
