"""API keys on the gRPC door: `authorization: Bearer <key>` or `x-api-key: <key>` metadata,
checked as the HTTP door checks its header (`pagedserve.serve_app.api_keys`).

Only `pagedserve.v1.Generate` is guarded; health and reflection stay open, as /health is on HTTP.
"""
from __future__ import annotations

from collections.abc import Callable

import grpc

from pagedserve.serve_app import errors
from pagedserve.serve_app.api_keys import authorized
from pagedserve.serve_app.grpc_api import status
from pagedserve.serve_app.grpc_api.schema import SERVICE_NAME

GUARDED_PREFIX = f"/{SERVICE_NAME}/"


def key_headers(metadata) -> tuple[bytes, bytes]:
    """A call's `authorization` and `x-api-key` metadata (empty where absent)."""
    headers = {key.lower(): value for key, value in metadata or ()}
    return tuple(value.encode() if isinstance(value, str) else value
                 for value in (headers.get("authorization", b""), headers.get("x-api-key", b"")))


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a guarded call without an accepted key with UNAUTHENTICATED; `on_refused(method)`
    is told of each refusal (the request counter)."""

    def __init__(self, api_keys: list[str], on_refused: Callable[[str], None]):
        self.keys = [key.encode() for key in api_keys]
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if (handler is None or not self.keys or not method.startswith(GUARDED_PREFIX)
                or authorized(*key_headers(handler_call_details.invocation_metadata), self.keys)):
            return handler
        self.on_refused(method)
        return refusal(handler)


def refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""
    async def refuse(request, context: grpc.aio.ServicerContext):
        await status.abort(context, errors.unauthorized())

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    build = kinds[(handler.request_streaming, handler.response_streaming)]
    return build(refuse, request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
