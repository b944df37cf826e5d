"""OpenAI-shaped errors as gRPC status codes: the one mapping the gRPC door answers with.

An oversized request (413) is RESOURCE_EXHAUSTED, the code gRPC itself gives a message over
`grpc.max_receive_message_length`, so a client sees one code for one failure whichever side
refused it. A full server (429) is RESOURCE_EXHAUSTED too, and carries `retry-after` in its
trailing metadata, as 503's UNAVAILABLE does.
"""
from __future__ import annotations

import grpc

from pagedserve.serve_app.errors import OpenAIError

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
# The other way, for the request counter's status_code label: an RPC counts as the HTTP request
# that would have ended the same way. A client that cancelled counts as nginx's 499.
HTTP_STATUS = {grpc.StatusCode.OK: 200, grpc.StatusCode.CANCELLED: 499,
               grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.DEADLINE_EXCEEDED: 408,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503}


def status_code(error: OpenAIError) -> grpc.StatusCode:
    return STATUS_CODES.get(error.status_code, grpc.StatusCode.INTERNAL)


def details(error: OpenAIError) -> str:
    """The message, led by the field it is about ("temperature: ...")."""
    return f"{error.param}: {error.message}" if error.param else error.message


def trailing_metadata(error: OpenAIError) -> tuple[tuple[str, str], ...]:
    if error.retry_after_s is None:
        return ()
    return (("retry-after", str(error.retry_after_s)),)


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


async def abort(context: grpc.aio.ServicerContext, error: OpenAIError) -> None:
    """End the RPC with the error's status (raises, as `context.abort` does)."""
    context.set_trailing_metadata(trailing_metadata(error))
    await context.abort(status_code(error), details(error))
