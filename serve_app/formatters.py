"""Build OpenAI completion / chat objects from merged replica deltas, whole or as stream chunks.

Chunk order follows OpenAI: chat sends a role delta per choice first, then content deltas, then a
chunk with an empty delta and the `finish_reason`; with `stream_options.include_usage` a last
chunk with `choices: []` and the usage (vLLM's `continuous_usage_stats` adds usage to every chunk).
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve.replicas.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedserve.serve_app import tool_calls
from pagedserve.serve_app.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest,
                                ChatCompletionResponse, ChatCompletionStreamResponse, ChatStreamChoice,
                                ChoiceLogprobs, CompletionChoice, CompletionLogprobs,
                                CompletionRequest, CompletionResponse, CompletionStreamResponse,
                                CompletionTokensDetails, Usage,
                                DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall,
                                ToolCall, random_id)
from pagedserve.serve_app.reasoning import ChatReasoning, ReasoningSplitter
from pagedserve.serve_app.responses import ChoiceState, LogprobFormatter, PromptState, usage
from pagedserve.serve_app.tool_call_parser import CallStart, Content, Event, ToolCallParser

Merged = AsyncIterator[tuple[int, RequestOutput]]


class _Formatter:
    OBJECT = ""  # the chunk's "object"
    TEXT_FIELD = ""  # how a choice carries its text: '"text":' or '"delta":{"content":'
    TEXT_END = ""

    def __init__(self, request, info, request_id: str, num_prompts: int, sse: bool = False):
        self.request = request
        self.created = int(time.time())
        # sse: the HTTP path. A chunk that only carries text (the per-token case) is rendered
        # straight to its server-sent event, without building and dumping a pydantic model; the
        # bytes are the same as the model's `model_dump_json()`.
        self.sse = sse and not request.continuous_usage
        self._head = (f'data: {{"id":{json.dumps(request_id)},"object":"{self.OBJECT}",'
                      f'"created":{self.created},"model":{json.dumps(info.name)},'
                      f'"choices":[{{"index":')
        self.model = info.name
        self.tokenizer = info.tokenizer
        self.request_id = request_id
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

    def _usage(self) -> Usage:
        return usage(self.states)

    def _chunk_usage(self):
        return self._usage() if self.request.continuous_usage else None

    def _text_event(self, index: int, text: str) -> str:
        return (f'{self._head}{index},{self.TEXT_FIELD}{json.dumps(text, ensure_ascii=False)}'
                f'{self.TEXT_END},"logprobs":null,"finish_reason":null,"stop_reason":null}}],'
                f'"usage":null}}\n\n')


class CompletionFormatter(_Formatter):
    OBJECT, TEXT_FIELD, TEXT_END = "text_completion", '"text":', ""

    def __init__(self, request: CompletionRequest, info, request_id: str, prompts, sse: bool = False):
        super().__init__(request, info, request_id, len(prompts), sse)
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
                                  choices=choices, usage=self._usage())

    def _chunk(self, choices: list[CompletionChoice], final_usage=None) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                        choices=choices, usage=final_usage or self._chunk_usage())

    async def stream(self, merged: Merged) -> AsyncIterator[CompletionStreamResponse | str]:
        """Chunks; with `sse`, text-only ones as ready server-sent events (str)."""
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
            for cd in delta.outputs:
                index = p * self.n + cd.index
                if cd.text or cd.token_ids:
                    logprobs = None
                    if want_logprobs:
                        logprobs = self.logprobs.completion(cd.token_ids, cd.logprobs or [],
                                                            offsets[p][cd.index])
                    offsets[p][cd.index] += len(cd.text)
                    if self.sse and logprobs is None:
                        yield self._text_event(index, cd.text)
                    else:
                        yield self._chunk([CompletionChoice(index=index, text=cd.text,
                                                            logprobs=logprobs)])
                if cd.finish_reason is not None:
                    yield self._chunk([CompletionChoice(index=index, text="",
                                                        finish_reason=cd.finish_reason,
                                                        stop_reason=cd.stop_reason)])
        if self.request.include_usage:
            yield self._chunk([], self._usage())


class ChatFormatter(_Formatter):
    OBJECT, TEXT_FIELD, TEXT_END = "chat.completion.chunk", '"delta":{"content":', "}"

    def __init__(self, request: ChatCompletionRequest, info, request_id: str, sse: bool = False,
                 tools: tool_calls.ToolSpec | None = None, prompt_text: str | None = None):
        super().__init__(request, info, request_id, 1, sse)
        self.logprobs = LogprobFormatter(info.tokenizer, request.top_logprobs or 0)
        self.tools = tools if tools is not None and tools.mode != "none" else None
        # A reasoning model's thinking goes to reasoning_content; tools and text read the answer.
        self.reasoning = (ChatReasoning(info.reasoning_parser, prompt_text or "", info.tokenizer)
                          if info.reasoning_parser is not None else None)

    def _splitter(self) -> ReasoningSplitter | None:
        return self.reasoning.splitter() if self.reasoning is not None else None

    def _usage(self) -> Usage:
        total = usage(self.states)
        if self.reasoning is not None:
            total.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(
                self.reasoning.num_tokens(c.token_ids) for c in self.states[0].choices))
        return total

    def _message(self, choice: ChoiceState) -> tuple[AssistantMessage, str | None]:
        """The message of a finished choice, and its finish reason ("tool_calls" for calls)."""
        reasoning, text = None, choice.text
        if self.reasoning is not None:
            reasoning, text = self._splitter().split(choice.text)
            if not self.request.include_reasoning:
                reasoning = None
        if self.tools is None or choice.finish_reason not in ("stop", "length") or text is None:
            return (AssistantMessage(content=text, reasoning_content=reasoning),
                    choice.finish_reason)
        content, calls = tool_calls.parse_calls(text, self.tools)
        if not calls:
            return AssistantMessage(content=text, reasoning_content=reasoning), choice.finish_reason
        message = AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=[
            ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])
        return message, "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason

    async def collect(self, merged: Merged) -> ChatCompletionResponse:
        state = self.states[0]
        async for _, delta in merged:
            state.add(delta)
        choices = []
        for i, c in enumerate(state.choices):
            message, finish_reason = self._message(c)
            choices.append(ChatChoice(index=i, message=message,
                                      logprobs=self.logprobs.chat(c.token_ids, c.logprobs)
                                      if self.request.logprobs else None,
                                      finish_reason=finish_reason, stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=choices, usage=self._usage())

    def _chunk(self, choices: list[ChatStreamChoice], final_usage=None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created,
                                            model=self.model, choices=choices,
                                            usage=final_usage or self._chunk_usage())

    async def stream(self, merged: Merged) -> AsyncIterator[ChatCompletionStreamResponse | str]:
        """Chunks; with `sse`, text-only ones as ready server-sent events (str)."""
        if self.tools is not None:
            async for chunk in self._stream_tools(merged):
                yield chunk
            return
        state = self.states[0]
        splitters = [self._splitter() for _ in range(self.n)]
        role_sent = False
        async for _, delta in merged:
            state.add(delta)
            if not role_sent:
                role_sent = True
                for i in range(self.n):
                    yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                     content=""))])
            for cd in delta.outputs:
                reasoning, text = self._split(splitters[cd.index], cd)
                if reasoning:
                    yield self._delta(cd.index, DeltaMessage(reasoning_content=reasoning))
                if text or (self.request.logprobs and cd.token_ids):
                    logprobs = self.logprobs.chat(cd.token_ids, cd.logprobs or []) \
                        if self.request.logprobs else None
                    if self.sse and logprobs is None:
                        yield self._text_event(cd.index, text)
                    else:
                        yield self._chunk([ChatStreamChoice(index=cd.index,
                                                            delta=DeltaMessage(content=text),
                                                            logprobs=logprobs)])
                if cd.finish_reason is not None:
                    yield self._chunk([ChatStreamChoice(index=cd.index, delta=DeltaMessage(),
                                                        finish_reason=cd.finish_reason,
                                                        stop_reason=cd.stop_reason)])
        if self.request.include_usage:
            yield self._chunk([], self._usage())

    async def _stream_tools(self, merged: Merged) -> AsyncIterator[ChatCompletionStreamResponse]:
        """Calls stream as OpenAI's do: a call's id and name once they are known, then its
        arguments as they are generated; in "auto", text streams as content until a call starts."""
        state = self.states[0]
        parsers = [ToolCallParser(self.tools) for _ in range(self.n)]
        # Per choice, the tokens whose logprobs no chunk has carried yet: text the parser holds
        # back (a possible tag, a call's name) sends its tokens' logprobs with the next chunk.
        pending = [_PendingLogprobs() for _ in range(self.n)] if self.request.logprobs else None
        splitters = [self._splitter() for _ in range(self.n)]
        role_sent = False
        async for _, delta in merged:
            state.add(delta)
            if not role_sent:
                role_sent = True
                content = None if self.tools.constrained else ""
                for i in range(self.n):
                    yield self._delta(i, DeltaMessage(role="assistant", content=content))
            for cd in delta.outputs:
                i = cd.index
                tokens = pending[i].add(cd) if pending else None
                reasoning, text = self._split(splitters[i], cd)
                if reasoning:
                    yield self._delta(i, DeltaMessage(reasoning_content=reasoning))
                for chunk in self._tool_chunks(i, parsers[i].feed(text), tokens):
                    yield chunk
                if cd.finish_reason is None:
                    continue
                for chunk in self._tool_chunks(i, parsers[i].finish(), tokens):
                    yield chunk
                finish_reason = cd.finish_reason
                if parsers[i].calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
                yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(),
                                                    logprobs=self._take_logprobs(tokens),
                                                    finish_reason=finish_reason,
                                                    stop_reason=cd.stop_reason)])
        if self.request.include_usage:
            yield self._chunk([], self._usage())

    def _tool_chunks(self, index: int, events: list[Event], tokens: _PendingLogprobs | None):
        """A chunk per event; the first to cover generated text carries the logprobs of the
        tokens pending so far (a named function's call starts before any text)."""
        for event in events:
            named_start = isinstance(event, CallStart) and self.tools.mode == "named"
            logprobs = None if named_start else self._take_logprobs(tokens)
            if isinstance(event, Content):
                yield self._text_event(index, event.text) if self.sse and logprobs is None else \
                    self._delta(index, DeltaMessage(content=event.text), logprobs)
                continue
            if isinstance(event, CallStart):
                call = DeltaToolCall(index=event.index, id=random_id("call"), type="function",
                                     function=DeltaFunctionCall(name=event.name, arguments=""))
            else:
                call = DeltaToolCall(index=event.index,
                                     function=DeltaFunctionCall(arguments=event.text))
            yield self._delta(index, DeltaMessage(tool_calls=[call]), logprobs)

    def _split(self, splitter: ReasoningSplitter | None, delta: CompletionOutput) -> tuple[str, str]:
        """A delta's (reasoning, answer) text; at the choice's end, with what was held back."""
        if splitter is None:
            return "", delta.text
        reasoning, text = splitter.feed(delta.text)
        if delta.finish_reason is not None:
            more_reasoning, more_text = splitter.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        return (reasoning if self.request.include_reasoning else ""), text

    def _take_logprobs(self, tokens: _PendingLogprobs | None) -> ChoiceLogprobs | None:
        if tokens is None or not tokens.token_ids:
            return None
        logprobs = self.logprobs.chat(tokens.token_ids, tokens.positions)
        tokens.token_ids, tokens.positions = [], []
        return logprobs

    def _delta(self, index: int, delta: DeltaMessage,
               logprobs: ChoiceLogprobs | None = None) -> ChatCompletionStreamResponse:
        return self._chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs)])


@dataclass(slots=True)
class _PendingLogprobs:
    """One choice's generated tokens that no chunk has carried the logprobs of yet."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[PositionLogprobs] = field(default_factory=list)

    def add(self, delta: CompletionOutput) -> _PendingLogprobs:
        self.token_ids += delta.token_ids
        self.positions += delta.logprobs or []
        return self
