"""The Responses API door: `/v1/responses` create, retrieve and delete, on the chat pipeline.

A request becomes a chat request (`response_items.chat_request`) continuing the conversation of
its `previous_response_id`, runs through `Ingress.chat` (so validation, limits, routing, metrics
and cancellation are the chat route's), and its answer becomes output items, whole or as typed
events (`response_stream`). With `store` (OpenAI's default) the response and its conversation go
to the shared ResponseStore once complete.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from pagedserve.serve_app import errors, response_items
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.protocol.responses import (
    DeletedResponse, ResponseObject, ResponsesRequest,
)
from pagedserve.serve_app.response_stream import ResponseEvents
from pagedserve.serve_app.sse import named_event

logger = logging.getLogger(__name__)


def _sse(event: dict) -> str:
    return named_event(event["type"], json.dumps(event, ensure_ascii=False))


def _as_is(event: dict) -> dict:
    return event


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, param=param,
                       code="response_not_found")


class ResponsesDoor:
    def __init__(self, chat, store, retry_after_s: int):
        """chat: the ingress's chat method; store: a handle to the ResponseStore deployment."""
        self.chat = chat
        self.store = store
        self.retry_after_s = retry_after_s

    async def create(self, request: ResponsesRequest, sse_events: bool = False):
        """A ResponseObject, or (request.stream) an async iterator of events: dicts, or ready
        server-sent events with `sse_events`."""
        history = []
        if request.previous_response_id:
            history = (await self._load(request.previous_response_id,
                                        "previous_response_id"))["messages"]
        chat, conversation = response_items.chat_request(request, history)
        response = response_items.new_response(request)
        answer = await self.chat(chat)
        if not request.stream:
            response_items.completed(response, answer)
            if request.store:
                await self._save(response, conversation)
            return response
        return self._stream(request, response, answer, conversation,
                            _sse if sse_events else _as_is)

    async def _stream(self, request: ResponsesRequest, response: ResponseObject, chunks,
                      conversation: list[dict], render) -> AsyncIterator:
        events = ResponseEvents(response)
        try:
            async for event in events.events(chunks):
                yield render(event)
            if request.store:
                # Stored before the last event: a client that continues from the response as
                # soon as it reads `response.completed` finds it, even if it hangs up at once.
                await asyncio.shield(self._save(response, conversation))
            yield render(events.completed())
        except OpenAIError as exc:
            for event in events.failed(exc):
                yield render(event)
        except Exception as exc:  # noqa: BLE001 - a bug after the stream started: tell the client
            logger.exception("responses stream failed")
            for event in events.failed(errors.internal_error(exc)):
                yield render(event)
        finally:
            await chunks.aclose()  # a client that left: the chat stream aborts its request

    async def retrieve(self, response_id: str) -> ResponseObject:
        return ResponseObject.model_validate((await self._load(response_id))["response"])

    async def delete(self, response_id: str) -> DeletedResponse:
        if not await self._call("delete", response_id):
            raise not_found(response_id)
        return DeletedResponse(id=response_id)

    async def _load(self, response_id: str, param: str | None = None) -> dict:
        blob = await self._call("get", response_id)
        if blob is None:
            raise not_found(response_id, param)
        return json.loads(blob)

    async def _save(self, response: ResponseObject, conversation: list[dict]) -> None:
        record = {"response": response.model_dump(mode="json"),
                  "messages": [*conversation, response_items.assistant_message(response)]}
        try:
            stored = await self._call("put", response.id, json.dumps(record).encode())
        except OpenAIError:  # the answer stands; only its later retrieval is lost
            logger.warning("could not store response %s", response.id)
            return
        if not stored:
            logger.warning("response %s is larger than the store and was not stored", response.id)

    async def _call(self, method: str, *args):
        try:
            return await getattr(self.store, method).remote(*args)
        except Exception as exc:  # noqa: BLE001 - the store's replica is down or restarting
            logger.debug("response store %s failed: %r", method, exc)
            raise errors.unavailable("the response store is unavailable; retry the request",
                                     self.retry_after_s) from None
