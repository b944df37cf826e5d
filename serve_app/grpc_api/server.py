"""GRPCDoor: an ingress replica serving `pagedserve.v1.Generate` itself, beside its HTTP door.

The server runs on the replica's event loop (`grpc.aio`), with the API-key interceptor, the
standard health service and server reflection (so `grpcurl -plaintext host:port list` works).
Every ingress replica on a node binds the same port: gRPC sets SO_REUSEPORT on its listening
sockets on Linux (channel option `grpc.so_reuseport`, on by default, set here so it stays so) and
the kernel spreads connections over the replicas. A port held by anything but a door of this
application is refused, as the HTTP door refuses one.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.serve_app.grpc_api import schema
from pagedserve.serve_app.grpc_api.auth import APIKeyInterceptor
from pagedserve.serve_app.grpc_api.health import DOOR_METADATA_KEY, HealthServicer
from pagedserve.serve_app.grpc_api.servicer import GenerateServicer

logger = logging.getLogger(__name__)

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# How long a starting replica waits on whatever already listens on its port to say whose it is.
CLAIM_CHECK_TIMEOUT_S = 5.0


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_host(host: str) -> str:
    """Where a client on this machine reaches a server listening on `host`."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


async def check_port_unclaimed(host: str, port: int, door_id: str) -> None:
    """Raise unless nothing listens on host:port or another gRPC door of this application does."""
    near = local_host(host)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(near, port),
                                           CLAIM_CHECK_TIMEOUT_S)
    except (OSError, TimeoutError):
        return
    writer.close()
    async with grpc.aio.insecure_channel(address(near, port)) as channel:
        call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=CLAIM_CHECK_TIMEOUT_S)
        try:
            owner_id = dict(await call.initial_metadata() or ()).get(DOOR_METADATA_KEY)
        except grpc.RpcError:
            owner_id = None
        finally:
            call.cancel()
    if owner_id == door_id:
        return
    owner = f"another pagedserve application ({owner_id})" if owner_id else "another server"
    raise RuntimeError(f"the ingress cannot serve gRPC on {host}:{port}: {owner} listens there; "
                       f"choose another `grpc_port`")


class GRPCDoor:
    """`door_id` names the application: its replicas share the port, nobody else may."""

    def __init__(self, ingress, host: str, port: int, door_id: str):
        self.ingress = ingress
        self.host, self.port = host, port
        self.door_id = door_id
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        await check_port_unclaimed(self.host, self.port, self.door_id)
        settings = self.ingress.settings
        generate = GenerateServicer(self.ingress)
        refused = grpc.StatusCode.UNAUTHENTICATED
        interceptor = APIKeyInterceptor(
            settings.api_keys, lambda method: generate.count(method.rsplit("/", 1)[1], refused))
        server = grpc.aio.server(interceptors=[interceptor], options=[
            ("grpc.so_reuseport", 1),
            # A request over the body limit is refused by gRPC itself (RESOURCE_EXHAUSTED).
            ("grpc.max_receive_message_length", settings.limits.max_request_body_bytes)])
        schema.modules()[1].add_GenerateServicer_to_server(generate, server)
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(self.ingress, self.door_id),
                                                     server)
        reflection.enable_server_reflection(
            (schema.SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            server.add_insecure_port(address(self.host, self.port))
        except RuntimeError as exc:
            raise RuntimeError(f"the ingress cannot serve gRPC on {self.host}:{self.port} "
                               f"({exc}); choose another `grpc_port`") from None
        await server.start()
        self._server = server
        logger.info("ingress serving gRPC on %s:%d", self.host, self.port)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once, let those in flight finish for up to grace_s, then cancel
        them (each cancelled stream aborts its engine request)."""
        if self._server is not None:
            await self._server.stop(max(grace_s, 0.0))
