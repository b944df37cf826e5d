"""Reading tool calls out of a completion while it is generated, one text delta at a time.

The same parser reads a finished completion (fed whole) and a stream (fed delta by delta), so a
streamed call's argument fragments concatenate to exactly the arguments of the non-streamed
answer, however the text was split. Its events: `Content(text)`, `CallStart(index, name)` once a
call's name is read, then `Arguments(index, text)` as the arguments value is generated.

What each `tool_choice` mode reads:
- named: the whole text is the arguments of the named function.
- required: a JSON array of `{"name": ..., "arguments": {...}}` objects (the grammar's shape).
- auto: text that starts with `{` or `[` is read as such a call or list of calls; if it turns
  out to be none (no known function name), it is plain content after all. Otherwise the text
  streams as content until a Hermes-style `<tool_call>` block starts; the blocks hold calls and
  the text around them is dropped, as is the whitespace before the first one. Where no call was
  found at all, the withheld text is content in the end.
A call's arguments are the model's own text for an object (or array) value, so they stream
character by character; a JSON-string value (some models write the arguments as a string) is
decoded, and "parameters" is read as "arguments" (Llama 3's key). A call cut off by max_tokens
keeps the arguments generated so far.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.serve_app.tool_calls import ToolSpec

TAG = "<tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"
_END, _ABORT = "end", "abort"  # what a JSON character can do to the call value being read


@dataclass(slots=True)
class Content:
    text: str


@dataclass(slots=True)
class CallStart:
    index: int
    name: str


@dataclass(slots=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


class ToolCallParser:
    """Incremental reader of one choice's tool calls: `feed(delta)` and `finish()` return the
    events that text made certain; `calls` and `content` hold what was read so far."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.calls: list[list[str]] = []  # [name, arguments] per call, in index order
        self._content_parts: list[str] = []
        self._events: list[Event] = []
        self._mode = {"named": "named", "required": "json", "none": "none"}.get(spec.mode, "start")
        self._bare = False  # reading a call value that may still turn out to be content
        self._held = ""  # text whose role the next characters decide
        self._withheld: list[str] = []  # text not emitted: content in the end if no call is found
        self._state, self._in_array = "top", False

    @property
    def content(self) -> str | None:
        return "".join(self._content_parts) or None

    def feed(self, text: str) -> list[Event]:
        self._events = []
        if self._mode == "named" and not self.calls:
            self._start_call(self.spec.named)
        while text:
            text = getattr(self, f"_read_{self._mode}")(text)
        return self._events

    def finish(self) -> list[Event]:
        self._events = []
        if self._mode == "named" and not self.calls:
            self._start_call(self.spec.named)
        elif not self.calls:
            self._emit_content("".join(self._withheld) + self._held)
        self._withheld, self._held = [], ""
        return self._events

    # -- modes: each consumes text and returns what a new mode must read ----------------------
    def _read_named(self, text: str) -> str:
        self._emit_arguments(0, text)
        return ""

    def _read_none(self, text: str) -> str:
        self._emit_content(text)
        return ""

    def _read_start(self, text: str) -> str:
        held = self._held + text
        head = held.lstrip(_WHITESPACE)
        if not head:
            self._held = held
            return ""
        self._held = ""
        if head[0] in "{[":
            self._withheld = [held[:len(held) - len(head)]]
            self._begin_value(bare=True)
            return head
        self._mode = "content"
        return held

    def _read_content(self, text: str) -> str:
        return self._until_tag(text, as_content=True)

    def _read_between(self, text: str) -> str:
        """After a call value: everything is dropped until the next `<tool_call>`."""
        return self._until_tag(text, as_content=False)

    def _until_tag(self, text: str, as_content: bool) -> str:
        buffer = self._held + text
        at = buffer.find(TAG)
        # Held: the end that may begin a tag, and (as content) the whitespace before it, which
        # is dropped if a call follows.
        head = buffer[:at] if at >= 0 else buffer[:len(buffer) - _partial_tag(buffer)]
        if as_content:
            kept = head.rstrip()
            self._emit_content(kept)
        else:
            kept = head
            self._withheld.append(kept)
        if at < 0:
            self._held = buffer[len(kept):]
            return ""
        self._withheld.append(buffer[len(kept):at + len(TAG)])
        self._held = ""
        self._begin_value(bare=False)
        return buffer[at + len(TAG):]

    def _read_json(self, text: str) -> str:
        for k, c in enumerate(text):
            status = self._json_char(c)
            if status is None:
                continue
            self._withheld.append(text[:k + 1])
            rest = text[k + 1:]
            if status == _ABORT and self._bare and not self.calls:
                self._mode = "content"  # it was no call: all of it is content
                rest = "".join(self._withheld) + rest
                self._withheld = []
            else:
                self._mode = "between"
            return rest
        self._withheld.append(text)
        return ""

    # -- the JSON of a call value: an object or an array of objects ---------------------------
    def _begin_value(self, bare: bool) -> None:
        self._mode, self._bare, self._state, self._in_array = "json", bare, "top", False

    def _json_char(self, c: str) -> str | None:
        state = self._state
        if state == "value":
            return self._value_char(c)
        if c in _WHITESPACE:
            return None
        if state == "keys":
            if c == '"':
                return self._begin_member_value("key", "string", c)
            if c == "}":
                return self._end_call()
            return None if c == "," else _ABORT
        if state == "colon":
            if c != ":":
                return _ABORT
            self._state = "member"
            return None
        if state == "member":
            return self._begin_member(c)
        if state == "top" and c == "[":
            self._state, self._in_array = "elements", True
            return None
        if c == "{" and state in ("top", "elements"):
            self._begin_call()
            return None
        if state == "elements" and c in ",]":
            return _END if c == "]" else None
        return _ABORT

    def _begin_call(self) -> None:
        self._state = "keys"
        self._name: str | None = None
        self._key: str | None = None
        self._index: int | None = None  # set once the name is known and valid
        self._invalid = self._args_started = False
        self._pending_args: list[str] = []  # arguments read before the name

    def _begin_member(self, c: str) -> str | None:
        if c in ",}]":
            return _ABORT
        kind = "composite" if c in "{[" else "string" if c == '"' else "scalar"
        if self._key == "name" and self._name is None:
            if kind != "string":
                self._invalid = True
                return self._maybe_abort() or self._begin_member_value("skip", kind, c)
            return self._begin_member_value("name", kind, c)
        if self._key in ARGUMENT_KEYS and not self._args_started:
            self._args_started = True
            return self._begin_member_value("args", kind, c)
        return self._begin_member_value("skip", kind, c)

    def _begin_member_value(self, sink: str, kind: str, c: str) -> str | None:
        self._state, self._sink, self._kind = "value", sink, kind
        self._raw: list[str] = []
        self._depth, self._in_string, self._escape = 0, False, False
        return self._value_char(c)

    def _value_char(self, c: str) -> str | None:
        kind = self._kind
        if kind == "scalar":
            if c in ",}]" or c in _WHITESPACE:
                return self._end_member_value() or self._json_char(c)
            self._raw.append(c)
            return None
        if self._sink == "args" and kind == "composite":
            self._add_arguments(c)
        else:
            self._raw.append(c)
        if self._escape:
            self._escape = False
        elif self._in_string:
            if c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if kind == "string":
                    return self._end_member_value()
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                return self._end_member_value()
        return None

    def _end_member_value(self) -> str | None:
        sink, raw = self._sink, "".join(self._raw)
        self._state = "colon" if sink == "key" else "keys"
        if sink == "key":
            self._key = _decoded(raw)
        elif sink == "name":
            return self._name_read(_decoded(raw))
        elif sink == "args" and self._kind != "composite":
            value = _decoded(raw) if self._kind == "string" else raw
            self._add_arguments(value if isinstance(value, str) else raw)
        return None

    def _name_read(self, name) -> str | None:
        if self._name is not None or self._invalid:
            return None  # a call already judged invalid stays so
        self._name = name
        if name not in self.spec.functions or (self.calls and not self.spec.parallel):
            self._invalid = True
            return self._maybe_abort()
        self._index = len(self.calls)
        self._start_call(name)
        self._emit_arguments(self._index, "".join(self._pending_args))
        return None

    def _add_arguments(self, text: str) -> None:
        if self._index is not None:
            self._emit_arguments(self._index, text)
        elif not self._invalid:
            self._pending_args.append(text)

    def _end_call(self) -> str | None:
        if self._index is not None and not self._args_started:
            self._emit_arguments(self._index, "{}")
        if self._index is None:
            self._invalid = True
            if self._maybe_abort():
                return _ABORT
        if self._in_array:
            self._state = "elements"
            return None
        return _END

    def _maybe_abort(self) -> str | None:
        """A bare value that holds no call yet is not a call value: it is content."""
        return _ABORT if self._bare and not self.calls else None

    # -- events ----------------------------------------------------------------------------------
    def _emit_content(self, text: str) -> None:
        if not text:
            return
        self._content_parts.append(text)
        last = self._events[-1] if self._events else None
        if isinstance(last, Content):
            last.text += text
        else:
            self._events.append(Content(text))

    def _start_call(self, name: str) -> None:
        self.calls.append([name, ""])
        self._events.append(CallStart(len(self.calls) - 1, name))

    def _emit_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        self.calls[index][1] += text
        last = self._events[-1] if self._events else None
        if isinstance(last, Arguments) and last.index == index:
            last.text += text
        else:
            self._events.append(Arguments(index, text))


def _partial_tag(text: str) -> int:
    """The length of the longest end of text that may begin a `<tool_call>` tag."""
    for size in range(min(len(TAG) - 1, len(text)), 0, -1):
        if text.endswith(TAG[:size]):
            return size
    return 0


def _decoded(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None
