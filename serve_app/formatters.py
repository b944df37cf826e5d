"""Build OpenAI completion / chat objects from merged replica deltas, whole or as stream chunks.

Chunk order follows OpenAI: chat sends a role delta per choice first, then content deltas, then a
chunk with an empty delta and the `finish_reason`; with `stream_options.include_usage` a last
chunk with `choices: []` and the usage (vLLM's `continuous_usage_stats` adds usage to every chunk).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from replicas.deployment import GenerateDelta
from serve_app.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest,
                                ChatCompletionResponse, ChatCompletionStreamResponse, ChatStreamChoice,
                                CompletionChoice, CompletionLogprobs, CompletionRequest,
                                CompletionResponse, CompletionStreamResponse, DeltaMessage)
from serve_app.responses import LogprobFormatter, PromptState, usage

Merged = AsyncIterator[tuple[int, GenerateDelta]]


class _Formatter:
    def __init__(self, request, info, request_id: str, num_prompts: int):
        self.request = request
        self.model = info.name
        self.tokenizer = info.tokenizer
        self.request_id = request_id
        self.created = int(time.time())
        self.n = request.n
        self.states = [PromptState(request.n) for _ in range(num_prompts)]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.states)

    @property
    def num_cached_tokens(self) -> int:
        return sum(s.num_cached_tokens for s in self.states)

    @property
    def num_generated_tokens(self) -> int:
        return sum(s.num_generated_tokens for s in self.states)

    def _chunk_usage(self):
        return usage(self.states) if self.request.continuous_usage else None


class CompletionFormatter(_Formatter):
    def __init__(self, request: CompletionRequest, info, request_id: str, prompts):
        super().__init__(request, info, request_id, len(prompts))
        self.prompts = prompts
        self.logprobs = LogprobFormatter(info.tokenizer, request.logprobs or 0)

    def _prompt_text(self, p: int) -> str:
        prompt = self.prompts[p]
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _prompt_logprobs(self, p: int, out: CompletionLogprobs | None = None) -> CompletionLogprobs:
        ids = self.prompts[p].token_ids
        positions = self.states[p].prompt_logprobs or [None] * len(ids)
        return self.logprobs.completion(ids, positions, 0, out)

    async def collect(self, merged: Merged) -> CompletionResponse:
        async for p, delta in merged:
            self.states[p].add(delta)
        choices = []
        for p, state in enumerate(self.states):
            echo = self._prompt_text(p) if self.request.echo else ""
            for c, choice in enumerate(state.choices):
                logprobs = None
                if self.request.logprobs is not None:
                    logprobs = self._prompt_logprobs(p) if self.request.echo else CompletionLogprobs()
                    self.logprobs.completion(choice.token_ids, choice.logprobs, len(echo), logprobs)
                choices.append(CompletionChoice(index=p * self.n + c, text=echo + choice.text,
                                                logprobs=logprobs, finish_reason=choice.finish_reason,
                                                stop_reason=choice.stop_reason))
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage(self.states))

    def _chunk(self, choices: list[CompletionChoice], final_usage=None) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                        choices=choices, usage=final_usage or self._chunk_usage())

    async def stream(self, merged: Merged) -> AsyncIterator[CompletionStreamResponse]:
        want_logprobs = self.request.logprobs is not None
        offsets = [[0] * self.n for _ in self.states]
        echoed = [False] * len(self.states)
        async for p, delta in merged:
            self.states[p].add(delta)
            if self.request.echo and not echoed[p]:
                echoed[p] = True
                text = self._prompt_text(p)
                for c in range(self.n):
                    offsets[p][c] = len(text)
                    yield self._chunk([CompletionChoice(
                        index=p * self.n + c, text=text,
                        logprobs=self._prompt_logprobs(p) if want_logprobs else None)])
            for cd in delta.choices:
                index = p * self.n + cd.index
                if cd.text or cd.token_ids:
                    logprobs = None
                    if want_logprobs:
                        logprobs = self.logprobs.completion(cd.token_ids, cd.logprobs or [],
                                                            offsets[p][cd.index])
                    offsets[p][cd.index] += len(cd.text)
                    yield self._chunk([CompletionChoice(index=index, text=cd.text, logprobs=logprobs)])
                if cd.finish_reason is not None:
                    yield self._chunk([CompletionChoice(index=index, text="",
                                                        finish_reason=cd.finish_reason,
                                                        stop_reason=cd.stop_reason)])
        if self.request.include_usage:
            yield self._chunk([], usage(self.states))


class ChatFormatter(_Formatter):
    def __init__(self, request: ChatCompletionRequest, info, request_id: str):
        super().__init__(request, info, request_id, 1)
        self.logprobs = LogprobFormatter(info.tokenizer, request.top_logprobs or 0)

    async def collect(self, merged: Merged) -> ChatCompletionResponse:
        state = self.states[0]
        async for _, delta in merged:
            state.add(delta)
        choices = [ChatChoice(index=i, message=AssistantMessage(content=c.text),
                              logprobs=self.logprobs.chat(c.token_ids, c.logprobs)
                              if self.request.logprobs else None,
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for i, c in enumerate(state.choices)]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=choices, usage=usage(self.states))

    def _chunk(self, choices: list[ChatStreamChoice], final_usage=None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created,
                                            model=self.model, choices=choices,
                                            usage=final_usage or self._chunk_usage())

    async def stream(self, merged: Merged) -> AsyncIterator[ChatCompletionStreamResponse]:
        state = self.states[0]
        role_sent = False
        async for _, delta in merged:
            state.add(delta)
            if not role_sent:
                role_sent = True
                for i in range(self.n):
                    yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                     content=""))])
            for cd in delta.choices:
                if cd.text or (self.request.logprobs and cd.token_ids):
                    logprobs = self.logprobs.chat(cd.token_ids, cd.logprobs or []) \
                        if self.request.logprobs else None
                    yield self._chunk([ChatStreamChoice(index=cd.index,
                                                        delta=DeltaMessage(content=cd.text),
                                                        logprobs=logprobs)])
                if cd.finish_reason is not None:
                    yield self._chunk([ChatStreamChoice(index=cd.index, delta=DeltaMessage(),
                                                        finish_reason=cd.finish_reason,
                                                        stop_reason=cd.stop_reason)])
        if self.request.include_usage:
            yield self._chunk([], usage(self.states))
