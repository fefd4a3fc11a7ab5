"""The engine behind dcpjax.serve.tools.parsers: tool calls read from text as it is decoded.

A tool-call format is a `Grammar`: the markers that open tool-call markup in free text, and the
steps that read it (a literal, a field up to a delimiter, a JSON object, a choice of what comes
next). `ToolCallStream` runs a grammar over text fed in any pieces and emits OpenAI-style deltas:
content outside the markup once it cannot be the start of a marker, then for each call its name as
soon as it is known and its arguments piece by piece. Arguments are re-written as
`json.dumps(json.loads(text), ensure_ascii=False)` would write them (`JsonObjectWriter`), so the
pieces join to the same string however the text was split. Pure Python, no server imports.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from dcpjax.serve.tools.json_writer import JSON_WHITESPACE, JsonError, JsonObjectWriter

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ToolCall:
    """One parsed call: `arguments` is a JSON object as a string, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        """The call in an OpenAI chat message's `tool_calls` list."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class DeltaMessage:
    """One streamed piece: `content` text, or `tool_calls` holding one OpenAI tool-call delta.

    The first delta of call i is {"index": i, "id": ..., "type": "function", "function": {"name": ...}},
    the later ones {"index": i, "function": {"arguments": fragment}}.
    """

    content: str | None = None
    tool_calls: list[dict] | None = None

    def to_dict(self) -> dict:
        """The `delta` object of a chat.completion.chunk choice."""
        return {"content": self.content} if self.tool_calls is None else {"tool_calls": self.tool_calls}


@dataclass(frozen=True)
class Grammar:
    """A tool-call format, read by `ToolCallStream`.

    `sequences` names lists of steps; `start` is the one run first. Steps are tuples:
    ("text",) free text, where any of `markers` starts the sequence it names;
    ("lit", s) optional whitespace then s; ("until", delim, field) text up to delim ("name": the
    call's name); ("call",) begins a call; ("json", "call") a {"name": ..., "arguments"|"parameters":
    {...}} object; ("json", "args") the arguments object itself; ("end",) completes the call;
    ("choice", ((literal, sequence, consume), ...), default) what follows after optional whitespace,
    where default is "text", "plain" (the rest is content, not an error), "malformed", or "end"
    (the end of the text is fine, anything else malformed).
    """

    sequences: dict[str, tuple[tuple, ...]]
    markers: dict[str, str] = field(default_factory=dict)
    start: str = "text"


class _Malformed(Exception):
    pass


@dataclass
class _Call:
    index: int
    id: str = ""
    name: str | None = None
    name_json: str = ""
    arguments: str = ""
    arguments_done: bool = False
    sent: int = 0  # characters of `arguments` already emitted


def _held_suffix(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of `text` that could be the start of one of `markers`."""
    longest = max((len(m) for m in markers), default=1) - 1
    for n in range(min(len(text), longest), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ToolCallStream:
    """Tool calls read from text fed in pieces: `feed(delta_text)` for each piece, then `finish()`.

    Both return the `DeltaMessage`s that became certain. Content is text outside the markup, kept
    as written, except that a whitespace-only stretch next to the markup is dropped; text that could
    be the start of a marker is held back until it is known not to be one. When the markup turns out
    malformed (bad JSON, no name, unterminated at finish), `malformed` is set and its text, from its
    opening marker, is released as content, as is all text after it. Deltas already sent for that
    call (its name, some arguments) cannot be taken back: it is missing from `calls`, which holds
    the completed calls only.
    """

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.calls: list[ToolCall] = []
        self.malformed = False
        self._mode = "steps"  # "steps", "text" or "plain"
        self._steps = list(grammar.sequences[grammar.start])
        self._buf = ""  # text fed and not yet used
        self._raw = ""  # markup text used since the last completed call, released if it turns out malformed
        self._pending_ws = ""  # whitespace at the start of a text stretch
        self._stretch_has_text = False
        self._call: _Call | None = None
        self._json: JsonObjectWriter | None = None
        self._out: list[DeltaMessage] = []

    @property
    def tools_called(self) -> bool:
        """Whether any call has completed."""
        return bool(self.calls)

    def feed(self, delta_text: str) -> list[DeltaMessage]:
        """Reads the next piece of text; returns the deltas it settles."""
        self._buf += delta_text
        self._advance(final=False)
        return self._drain()

    def finish(self) -> list[DeltaMessage]:
        """Ends the text: releases what was held back; returns the last deltas."""
        self._advance(final=True)
        return self._drain()

    def _drain(self) -> list[DeltaMessage]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._out and self._out[-1].content is not None:
            self._out[-1].content += text
        else:
            self._out.append(DeltaMessage(content=text))

    def _tool_delta(self, delta: dict) -> None:
        last = self._out[-1].tool_calls[0] if self._out and self._out[-1].tool_calls else None
        if "id" not in delta and last and "id" not in last and last["index"] == delta["index"]:
            last["function"]["arguments"] += delta["function"]["arguments"]
        else:
            self._out.append(DeltaMessage(tool_calls=[delta]))

    def _advance(self, final: bool) -> None:
        while True:
            if self._mode == "plain":
                self._content(self._buf)
                self._buf = ""
                return
            if self._mode == "text":
                if not self._scan_text(final):
                    return
                continue
            step = self._steps.pop(0)
            try:
                done = getattr(self, "_op_" + step[0])(*step[1:], final=final)
            except (JsonError, _Malformed):
                self._to_plain(malformed=True)
                continue
            if not done:
                self._steps.insert(0, step)
                return

    def _to_plain(self, malformed: bool) -> None:
        self.malformed = self.malformed or malformed
        self._content(self._raw)
        self._raw, self._mode, self._call, self._json = "", "plain", None, None

    def _take(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _text(self, text: str) -> None:
        """Free text: whitespace-only stretches wait until text follows them."""
        if self._stretch_has_text:
            self._content(text)
        elif text.strip():
            self._content(self._pending_ws + text)
            self._pending_ws, self._stretch_has_text = "", True
        else:
            self._pending_ws += text

    def _scan_text(self, final: bool) -> bool:
        buf, markers = self._buf, self.grammar.markers
        hits = sorted((buf.find(m), m) for m in markers if m in buf)
        if hits:
            at, marker = hits[0]
            self._text(buf[:at])
            self._raw, self._pending_ws = self._pending_ws + marker, ""
            self._buf = buf[at + len(marker):]
            self._mode, self._steps = "steps", list(self.grammar.sequences[markers[marker]])
            return True
        keep = 0 if final else _held_suffix(buf, markers)
        self._text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        if final and not self.calls:  # no markup at all: the text was all content
            self._content(self._pending_ws)
        return False

    def _op_text(self, final: bool) -> bool:
        self._mode, self._raw, self._pending_ws, self._stretch_has_text = "text", "", "", False
        return True

    def _op_lit(self, literal: str, final: bool) -> bool:
        body = self._buf.lstrip(JSON_WHITESPACE)
        if body.startswith(literal):
            self._take(len(self._buf) - len(body) + len(literal))
            return True
        if literal.startswith(body) and not final:
            return False
        raise _Malformed(f"expected {literal!r}")

    def _op_until(self, delimiter: str, name: str, final: bool) -> bool:
        at = self._buf.find(delimiter)
        if at < 0:
            if final:
                raise _Malformed(f"no {delimiter!r}")
            return False
        value = self._buf[:at]
        self._take(at + len(delimiter))
        if name == "name":
            self._set_name(value.strip())
        return True

    def _op_call(self, final: bool) -> bool:
        self._call = _Call(index=len(self.calls))
        return True

    def _op_json(self, kind: str, final: bool) -> bool:
        if self._json is None:
            self._json = JsonObjectWriter()
        self._take(self._json.feed(self._buf))
        events, self._json.events = self._json.events, []
        for event in events:
            if kind == "call":
                self._call_event(*event)
            else:
                self._arguments_piece(event[2])
        self._flush_arguments()
        if self._json.done:
            self._json = None
            return True
        if final:
            raise _Malformed("unterminated JSON")
        return False

    def _call_event(self, kind: str, key: str | None, text: str) -> None:
        call = self._call
        if key == "name":
            if call.name is not None:
                raise _Malformed("two names")
            if kind == "piece":
                call.name_json += text
            else:
                self._set_name(json.loads(call.name_json))
        elif key in ARGUMENT_KEYS:
            if call.arguments_done:
                raise _Malformed("two argument objects")
            if kind == "end":
                call.arguments_done = True
            elif call.arguments or text == "{":
                self._arguments_piece(text)
            else:
                raise _Malformed("arguments are not an object")

    def _arguments_piece(self, text: str) -> None:
        self._call.arguments += text

    def _set_name(self, name) -> None:
        call = self._call
        if not isinstance(name, str) or not name.strip():
            raise _Malformed(f"bad name {name!r}")
        call.name, call.id = name, f"chatcmpl-tool-{uuid.uuid4().hex}"
        self._tool_delta({"index": call.index, "id": call.id, "type": "function", "function": {"name": name}})

    def _flush_arguments(self) -> None:
        call = self._call
        if call.name is not None and len(call.arguments) > call.sent:
            self._tool_delta({"index": call.index, "function": {"arguments": call.arguments[call.sent:]}})
            call.sent = len(call.arguments)

    def _op_end(self, final: bool) -> bool:
        call = self._call
        if call.name is None:
            raise _Malformed("no name")
        call.arguments = call.arguments or "{}"
        self._flush_arguments()
        self.calls.append(ToolCall(call.id, call.name, call.arguments))
        self._call, self._raw = None, ""
        return True

    def _op_choice(self, options: tuple, default: str, final: bool) -> bool:
        body = self._buf.lstrip(JSON_WHITESPACE)
        for literal, sequence, consume in options:
            if body.startswith(literal):
                self._take(len(self._buf) - len(body) + (len(literal) if consume else 0))
                self._steps = list(self.grammar.sequences[sequence])
                return True
        if not final and any(literal.startswith(body) for literal, _, _ in options):
            return False
        if default == "text" or (default == "end" and final):
            return self._op_text(final)
        if default == "plain":
            self._to_plain(malformed=False)
            return True
        raise _Malformed("unexpected text after a call")
