"""Incremental detokenization with stop strings, and single-token decoding for logprobs.

Text grows by diffing two decodes of a short window (the prefix/read-offset technique of vLLM and
TGI): `decode(ids[prefix:read])` was emitted already, `decode(ids[prefix:])` is the same plus the
new text. While the window's decode ends in U+FFFD the new tokens hold an incomplete UTF-8
character, so nothing is emitted until it completes; a character that never completes is dropped.
"""
from __future__ import annotations

from typing import Callable, Sequence as Seq

import tokenizers

# Prompt tokens kept to give the first output token its context (leading spaces, merges).
_PROMPT_CONTEXT = 5
# Drop emitted ids from the window once this many have piled up.
_TRIM_AT = 64
_REPLACEMENT = "\ufffd"


def _decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The fastest decode available: the Rust tokenizer when there is one, else the HF decode.

    Like vLLM's incremental detokenizer, no clean_up_tokenization_spaces is applied.
    """
    backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else getattr(
        tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def _added_tokens(tokenizer) -> dict[int, str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if decoder is None and hasattr(tokenizer, "get_added_tokens_decoder"):
        decoder = tokenizer.get_added_tokens_decoder()
    return {int(i): str(getattr(t, "content", t)) for i, t in (decoder or {}).items()}


def find_stop_string(text: str, num_new_chars: int, stop: Seq[str],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """The stop string that completes first within the last `num_new_chars` of `text`.

    Only the tail that can hold such a match is searched. Returns (stop string, length to cut the
    text to: its start, or its end when it is included), or None. "First" means the smallest end
    position, so the answer does not depend on how the text was split into tokens; on equal ends
    the match that starts first (the longer one) wins.
    """
    if num_new_chars <= 0 or not stop:
        return None
    new_start = len(text) - num_new_chars
    best: tuple[int, int, str] | None = None
    for stop_str in stop:
        start = text.find(stop_str, max(new_start - len(stop_str) + 1, 0))
        if start != -1:
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    if best is None:
        return None
    end, start, stop_str = best
    return stop_str, end if include_stop_str_in_output else start


class IncrementalDetokenizer:
    """Output text of one sequence, grown token by token, cut at the first stop string.

    `append(ids)` returns the text those tokens added to `.text`. Once a stop string matches,
    `.stop_str` is set, `.text` is cut (to before the stop string, or after it with
    include_stop_str_in_output) and further appends are ignored. Stream `visible_text(finished)`,
    never `.text`: it withholds a tail that could still become a stop string.
    Stop strings are only looked for in text produced after the first `min_tokens` tokens (vLLM).
    """

    def __init__(self, tokenizer, prompt_token_ids: Seq[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: Seq[str] | None = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        # vLLM: without spaces between special tokens, a special token right after another one
        # is emitted as its raw content (decoders such as WordPiece would insert a space).
        self._raw_added: dict[int, str] = {}
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._raw_added = _added_tokens(tokenizer)
        self._last_added = False
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.stop_str: str | None = None
        self.text = ""
        self._unchecked_from = 0  # text before this offset has been searched for stop strings
        self._set_stop(stop, include_stop_str_in_output)

    def _set_stop(self, stop: Seq[str] | None, include_stop_str_in_output: bool) -> None:
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # A partial stop string must never be streamed then retracted; an included one needs no
        # hold-back since the cut then falls after it.
        self._hold_back = 0
        if self.stop and not include_stop_str_in_output:
            self._hold_back = max(len(s) for s in self.stop) - 1

    def append(self, new_token_ids: Seq[int], stop_terminated: bool = False) -> str:
        """Decode new output tokens; returns the text they added to `.text` (after any stop cut).

        `stop_terminated`: the last id is an eos / stop token that ended the sequence; as in
        vLLM its text is left out unless include_stop_str_in_output, and stop strings are not
        searched.
        """
        if self.stop_str is not None:
            return ""
        new_token_ids = list(new_token_ids)
        skip_last = stop_terminated and not self.include_stop_str_in_output and bool(new_token_ids)
        if skip_last:
            new_token_ids.pop()
        old_len = len(self.text)
        if (len(new_token_ids) > 1 and not self.stop and not self._raw_added
                and self.num_output_tokens >= self.min_tokens):
            self.num_output_tokens += len(new_token_ids)
            self.text += self._steps(new_token_ids)
        else:
            for token_id in new_token_ids:
                self.num_output_tokens += 1
                self.text += self._step(token_id)
                if self.num_output_tokens <= self.min_tokens:
                    self._unchecked_from = len(self.text)
        self.num_output_tokens += skip_last
        if stop_terminated:
            self._unchecked_from = len(self.text)
        elif self.stop:
            self._search_stop()
        return self.text[old_len:]

    def _search_stop(self) -> None:
        match = find_stop_string(self.text, len(self.text) - self._unchecked_from, self.stop,
                                 self.include_stop_str_in_output)
        self._unchecked_from = len(self.text)
        if match is not None:
            self.stop_str, cut = match
            self.text = self.text[:cut]

    def visible_text(self, finished: bool) -> str:
        """The text a streaming client may see now: all of it once finished, else all but the
        last max(len(stop)) - 1 characters."""
        if finished or self.stop_str is not None or not self._hold_back:
            return self.text
        return self.text[:max(len(self.text) - self._hold_back, 0)]

    def _window_text(self) -> str:
        """The decode of the whole window; `_prefix_text` is its emitted part's."""
        ids = self._ids
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        return self._decode(ids[self._prefix_offset:])

    def _emitted(self) -> None:
        """The window's new ids were emitted: the next window starts where they did."""
        ids = self._ids
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _step(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        new_text = self._window_text()
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            piece = ""
        else:
            piece = new_text[len(self._prefix_text):]
            if self._raw_added:
                piece = self._raw_special(token_id, piece, single=len(ids) - self._read_offset == 1)
            self._emitted()
        if self._raw_added:
            self._last_added = token_id in self._raw_added
        return piece

    def _steps(self, token_ids: list[int]) -> str:
        """What `_step` would add token by token, from one decode of the window with all of them
        (a stream's coalesced delta: the ingress decodes its text, `serve_app/stream_text.py`):
        the window's text is the same however it grew. Token by token where the new text holds
        a broken character (unfinished at its end, or bytes that are no character: how many
        U+FFFD those read as depends on the window) or is empty, so that it is `_step`'s there."""
        ids = self._ids
        mark = len(ids)
        ids.extend(token_ids)
        piece = self._window_text()[len(self._prefix_text):]
        if not piece or _REPLACEMENT in piece:
            del ids[mark:]
            return "".join([self._step(token_id) for token_id in token_ids])
        # The next window starts where this piece does: on a character's edge (a window that
        # starts inside one, at a byte-fallback token, decodes it differently).
        self._emitted()
        return piece

    def _raw_special(self, token_id: int, piece: str, single: bool) -> str:
        content = self._raw_added.get(token_id)
        if content is not None and self._last_added and single:
            return content
        return piece


class TokenDecoder:
    """`decode_token(token_id)`: the text of one token for logprobs' `decoded_token`.

    What vLLM's OpenAI server returns as a logprob's `token`: `tokenizer.decode([token_id])`
    with its defaults (special tokens kept), so a byte fragment of a multi-byte character reads
    as U+FFFD; not convert_ids_to_tokens' byte-level form ("Ġworld"). Cached per id.
    """

    def __init__(self, tokenizer) -> None:
        if isinstance(tokenizer, tokenizers.Tokenizer):
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        else:
            self._decode = tokenizer.decode
        self._cache: dict[int, str] = {}

    def decode_token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text

    __call__ = decode_token
