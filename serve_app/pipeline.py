"""The request pipeline every route shares: the request record an engine core gets, and
starting, collecting and streaming its outputs under the request's deadline, with its metrics
recorded and its engine work cancelled when the client leaves or the stream fails."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pagedserve.replicas.core.block_hash import block_hashes
from pagedserve.replicas.core.lora_request import LoRARequest, adapter_root_hash
from pagedserve.replicas.core.sampling_params import ParamError, RequestOutputKind
from pagedserve.replicas.engine import protocol
from pagedserve.serve_app import errors
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.prompts import ModelInfo, Prompt
from pagedserve.serve_app.request_stream import RequestStream
from pagedserve.serve_app.stream_text import StreamText, take_text


def generate_request(request_id: str, prompt: Prompt, request, max_tokens: int | None,
                     logprobs: int | None, prompt_logprobs: int | None, info: ModelInfo,
                     prompt_param: str, lora: LoRARequest | None = None) -> protocol.AddRequest:
    """The record an engine core gets: the prompt within the model's context, the sampling
    parameters checked, the prefix's block hashes (seeded by the adapter's identity)."""
    num_prompt = len(prompt.token_ids)
    limit = info.max_model_len
    if max_tokens is None and num_prompt >= limit:
        message = (f"This model's maximum context length is {limit} tokens. However, your "
                   f"{prompt_param} resulted in {num_prompt} tokens. Please reduce the length "
                   f"of the {prompt_param}.")
    elif max_tokens is not None and num_prompt + max_tokens > limit:
        message = (f"This model's maximum context length is {limit} tokens. However, you "
                   f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                   f"{prompt_param}, {max_tokens} in the completion). Please reduce the length "
                   f"of the {prompt_param} or completion.")
    else:
        message = None
    if message:
        raise OpenAIError(message, 400, param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = limit - num_prompt
    for token_id in [*(request.stop_token_ids or []), *map(int, request.logit_bias or {})]:
        if not 0 <= token_id < info.vocab_size:
            raise errors.bad_request(f"token id {token_id} is outside the vocabulary "
                                     f"[0, {info.vocab_size})")
    try:
        params = request.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ParamError as exc:
        raise errors.bad_request(str(exc), exc.param) from None
    # A stream wants each step's new tokens; a whole response only the finished request,
    # unless the ingress must see its text as it grows, to stop it on a stop string.
    wants_deltas = request.stream or bool(params.stop)
    params.output_kind = RequestOutputKind.DELTA if wants_deltas else RequestOutputKind.FINAL_ONLY
    take_text(params)
    root = adapter_root_hash(lora.lora_int_id if lora is not None else None)
    return protocol.AddRequest(request_id, prompt.token_ids, params, request.priority,
                               block_hashes(prompt.token_ids, info.block_size, root), lora)


class RequestPipeline:
    """One ingress replica's way from request records to outputs: the engine client, the stream
    pacer, the metrics and the request timeout it runs them under."""

    def __init__(self, engines, pacer, metrics, request_timeout_s: float | None):
        self.engines = engines
        self.pacer = pacer
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s

    def deadline(self) -> float | None:
        timeout_s = self.request_timeout_s
        return time.monotonic() + timeout_s if timeout_s is not None else None

    async def within(self, awaitable, deadline: float | None):
        """awaitable, or the request's timeout error once its deadline passes."""
        if deadline is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise errors.request_timeout(self.request_timeout_s) from None

    async def start(self, requests: list[protocol.AddRequest], tokenizer,
                    deadline: float | None = None) -> list[RequestStream]:
        """Send every prompt to an engine core and wait for each first delta (errors surface
        here); `tokenizer` makes their text."""
        started = [self.engines.stream(r, StreamText(tokenizer, r.prompt_token_ids, r.params),
                                       self.pacer)
                   for r in requests]
        try:
            results = await self.within(
                asyncio.gather(*(s.prime() for s in started), return_exceptions=True), deadline)
        except OpenAIError as exc:  # waited past the deadline, for a core or in the queue
            results = [exc]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for s in started:
                s.cancel()
            raise failures[0]
        return started

    def record(self, formatter, info: ModelInfo, started: float, streams) -> None:
        if formatter.request.stream:
            first = min((s.first_delta_time for s in streams if s.first_delta_time),
                        default=None)
        else:  # only the last output came: the engine timed the first token
            ttfts = [s.ttft_s for s in formatter.states if s.ttft_s is not None]
            first = started + min(ttfts) if ttfts else None
        self.metrics.record_request(info.name, started, first, formatter.num_prompt_tokens,
                                    formatter.num_cached_tokens, formatter.num_generated_tokens)

    async def collected(self, formatter, merged, info: ModelInfo, started: float,
                        streams: list[RequestStream], deadline: float | None = None):
        try:
            return await self.within(formatter.collect(merged), deadline)
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        finally:
            self.record(formatter, info, started, streams)

    async def observed(self, chunks: AsyncIterator, formatter, info: ModelInfo, started: float,
                       streams: list[RequestStream], deadline: float | None = None
                       ) -> AsyncIterator:
        finished = False
        try:
            if deadline is None:
                async for chunk in chunks:
                    yield chunk
            else:  # each chunk awaited under the deadline (a task per chunk: only when asked)
                while True:
                    try:
                        chunk = await self.within(anext(chunks), deadline)
                    except StopAsyncIteration:
                        break
                    yield chunk
            finished = True
        finally:
            if not finished:  # the client left or the stream failed: stop the engines' work
                for s in streams:
                    s.cancel()
            self.record(formatter, info, started, streams)
