"""The standard `grpc.health.v1.Health` service, answered from the ingress's own checks.

SERVING while the ingress is healthy and ready (as /health and /health/ready on HTTP), for the
server as a whole ("") and for `pagedserve.v1.Generate`; NOT_SERVING otherwise. Each answer also
says, in its initial metadata, which application's door it is, so a starting replica can tell
a sibling sharing the port from a stranger holding it.
"""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.serve_app.grpc_api.schema import SERVICE_NAME

DOOR_METADATA_KEY = "pagedserve-door"
SERVICES = frozenset({"", SERVICE_NAME})
# How often a Watch looks again; it sends a message only when the status changed.
WATCH_PERIOD_S = 5.0


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, ingress, door_id: str):
        self.ingress = ingress
        self.door_id = door_id

    async def status(self) -> int:
        healthy, _ = await self.ingress.health()
        ready, _ = await self.ingress.ready()
        ServingStatus = health_pb2.HealthCheckResponse
        return ServingStatus.SERVING if healthy and ready else ServingStatus.NOT_SERVING

    async def _known(self, request, context: grpc.aio.ServicerContext) -> None:
        await context.send_initial_metadata(((DOOR_METADATA_KEY, self.door_id),))
        if request.service not in SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"service: unknown service {request.service!r}")

    async def Check(self, request, context: grpc.aio.ServicerContext):
        await self._known(request, context)
        return health_pb2.HealthCheckResponse(status=await self.status())

    async def Watch(self, request, context: grpc.aio.ServicerContext) -> None:
        await self._known(request, context)
        last = None
        while True:
            current = await self.status()
            if current != last:
                await context.write(health_pb2.HealthCheckResponse(status=current))
                last = current
            await asyncio.sleep(WATCH_PERIOD_S)
