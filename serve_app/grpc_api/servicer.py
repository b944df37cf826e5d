"""GenerateServicer: `pagedserve.v1.Generate` over the ingress's typed methods.

Every RPC goes through the methods the HTTP routes call (`completions`, `chat`, `embeddings`,
`models`), so limits, routing, admission, metrics and cancellation are the same on both doors.
Each RPC is counted under its own endpoint label with the HTTP status it would have had.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from pagedserve.serve_app import errors
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.grpc_api import schema, status, translation
from pagedserve.serve_app.protocol import CompletionRequest

logger = logging.getLogger(__name__)

# The request counter's endpoint label of each RPC.
ENDPOINTS = {"Generate": "grpc_generate", "Embed": "grpc_embed", "ListModels": "grpc_list_models"}


class GenerateServicer:
    """Registered with the generated `add_GenerateServicer_to_server`."""

    def __init__(self, ingress):
        self.ingress = ingress
        self.pb = schema.modules()[0]

    async def Generate(self, message, context: grpc.aio.ServicerContext) -> None:
        async with self._outcome("Generate", context):
            request = translation.generate_request(message)
            generate = (self.ingress.completions if isinstance(request, CompletionRequest)
                        else self.ingress.chat)
            chunks = await generate(request)
            # Written with context.write rather than yielded: a client that cancels or leaves
            # cancels this coroutine at the await it is in, so the finally closes the ingress's
            # chunks at once (the engine aborts the request and frees its KV blocks).
            try:
                async for chunk in chunks:
                    for response in translation.generate_responses(self.pb, chunk):
                        await context.write(response)
            finally:
                await chunks.aclose()

    async def Embed(self, message, context: grpc.aio.ServicerContext):
        async with self._outcome("Embed", context):
            request = translation.embedding_request(message)
            try:
                response = await self.ingress.embeddings(request)
            except OpenAIError as error:
                raise errors.renamed(error, translation.EMBED_FIELD_NAMES) from None
            return translation.embed_response(self.pb, response)

    async def ListModels(self, message, context: grpc.aio.ServicerContext):
        async with self._outcome("ListModels", context):
            return translation.list_models_response(self.pb, await self.ingress.models())

    @contextlib.asynccontextmanager
    async def _outcome(self, rpc: str, context: grpc.aio.ServicerContext):
        """Count the RPC under its endpoint, and end a failed one with its status."""
        code = grpc.StatusCode.OK
        try:
            yield
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every failure ends the RPC with a status
            error = self._error(exc)
            code = status.status_code(error)
            await status.abort(context, error)
        finally:
            self.count(rpc, code)

    @staticmethod
    def _error(exc: Exception) -> OpenAIError:
        """What the RPC ends with; a bug is INTERNAL, and logged."""
        if isinstance(exc, grpc.aio.AbortError):  # context.abort ended the RPC already
            raise exc
        if isinstance(exc, OpenAIError):
            return exc
        logger.exception("unhandled error in the gRPC serving path")
        return errors.internal_error(exc)

    def count(self, rpc: str, code: grpc.StatusCode) -> None:
        self.ingress.metrics.record_status(self.ingress.model_name(), ENDPOINTS[rpc],
                                           status.http_status(code))
