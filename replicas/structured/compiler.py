"""Compiles structured-output constraints into llguidance matchers on one worker thread.

The engine loop never compiles: `compile()` returns a Future at once; the request waits outside
the scheduler until it is done. Results (and errors) are cached by (kind, spec), so a repeated
schema costs a dictionary lookup and a matcher copy. The llguidance view of the tokenizer
(about a second to build for a 49k vocabulary) is built on the worker thread, on first use.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf

from pagedserve.replicas.core.sampling_params import ParamError, StructuredOutputsParams

# No free whitespace in generated JSON: with it a grammar never has to end (a weak model pads
# forever); these separators are json.dumps' defaults, so the output reads as usual.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint; ValueError where it cannot even be read."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if schema is True:
            schema = {}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted


class GrammarCompiler:
    """`compile(params) -> Future[llguidance.LLMatcher]`: a matcher in its start state, to be
    copied (never advanced) by each sequence; the Future fails with a ParamError naming the
    request field for a constraint llguidance rejects."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, params: StructuredOutputsParams) -> Future:
        key = (params.kind, params.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    @property
    def tokenizer(self):
        """llguidance's tokenizer (builds it: call from the worker, or where a second is fine)."""
        if self._ll_tokenizer is None:
            eos = self._eos_token_ids or None
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=eos)
        return self._ll_tokenizer

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        source = params.source
        try:
            grammar = grammar_text(params)
        except (ValueError, TypeError) as exc:
            raise ParamError(source, f"invalid {source}: {exc}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ParamError(source, f"invalid {source}: {matcher.get_error()}")
        self.num_compiled += 1
        return matcher

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
