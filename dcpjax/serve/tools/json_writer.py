"""JSON objects re-written piece by piece as json.dumps(json.loads(text), ensure_ascii=False) would.

Used by dcpjax.serve.tools.streaming so that a tool call's arguments can be streamed while they are
still being decoded and still join to exactly the string the whole text gives. Pure Python.
"""

from __future__ import annotations

import json
import math
import re

JSON_WHITESPACE = " \t\n\r"  # JSON's whitespace
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_DUMPED = {chr(i): json.dumps(chr(i))[1:-1] for i in range(0x20)} | {'"': '\\"', "\\": "\\\\"}
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_HEX = set("0123456789abcdefABCDEF")
_LITERALS = ("true", "false", "null")


class JsonError(ValueError):
    """The text is not one JSON object (or a lone surrogate, NaN/Infinity, or an out-of-range float)."""


class JsonObjectWriter:
    """Reads one JSON object a character at a time and writes it back in json.dumps' form.

    The output is `json.dumps(json.loads(text, strict=False), ensure_ascii=False)` (raw control
    characters inside strings are accepted and escaped), produced piece by piece: `events` gets
    ("piece", key, text) for each written piece, where key is the top-level key whose value the
    piece belongs to (None for the object's own braces, keys and separators), and ("end", key, "")
    when that value is complete. Duplicate keys are written as they come.
    """

    def __init__(self):
        self.events: list[tuple[str, str | None, str]] = []
        self.done = False
        self._stack: list[str] = []  # open containers, "{" or "["
        self._expect = "start"  # start | value | value_or_end | key | key_or_end | colon | comma_or_end
        self._token = ""  # "", "string", "number" or "literal"
        self._text = ""  # the number or literal read so far, or the hex digits of a \u escape
        self._escape = ""  # "", "\\" or "u"
        self._high = ""  # a high surrogate waiting for its low half
        self._is_key = False
        self._key = ""  # the decoded key being read
        self._top_key: str | None = None  # the top-level key whose value is being read

    def feed(self, text: str) -> int:
        """Reads `text` up to the end of the object; returns how many characters it used."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            self._char(ch)
        return len(text)

    def _put(self, text: str) -> None:
        self.events.append(("piece", self._top_key, text))

    def _char(self, ch: str) -> None:
        if self._token == "string":
            return self._string_char(ch)
        if self._token == "literal":
            return self._literal_char(ch)
        if self._token == "number":
            if ch in "+-.eE0123456789":
                self._text += ch
                return
            self._end_number()
        if ch not in JSON_WHITESPACE:
            self._structure(ch)

    def _structure(self, ch: str) -> None:
        expect, container = self._expect, self._stack[-1] if self._stack else ""
        if expect in ("start", "value", "value_or_end"):
            if expect == "value_or_end" and ch == "]":
                return self._close()
            if expect == "start" and ch != "{":
                raise JsonError(f"expected an object, got {ch!r}")
            return self._start_value(ch)
        if expect in ("key", "key_or_end") and ch == '"':
            self._token, self._is_key, self._key = "string", True, ""
            return self._put('"')
        if expect == "key_or_end" and ch == "}":
            return self._close()
        if expect == "colon" and ch == ":":
            self._put(": ")
            self._expect = "value"
            if len(self._stack) == 1:
                self._top_key = self._key
            return None
        if expect == "comma_or_end" and ch == ",":
            self._put(", ")
            self._expect = "key" if container == "{" else "value"
            return None
        if expect == "comma_or_end" and ch == {"{": "}", "[": "]"}[container]:
            return self._close()
        raise JsonError(f"unexpected {ch!r}")

    def _start_value(self, ch: str) -> None:
        if ch in "{[":
            self._put(ch)
            self._stack.append(ch)
            self._expect = "key_or_end" if ch == "{" else "value_or_end"
        elif ch == '"':
            self._token, self._is_key = "string", False
            self._put('"')
        elif ch in "-0123456789":
            self._token, self._text = "number", ch
        elif ch in "tfn":
            self._token, self._text = "literal", ch
        else:
            raise JsonError(f"unexpected {ch!r}")

    def _close(self) -> None:
        self._put("}" if self._stack.pop() == "{" else "]")
        self._value_done()

    def _value_done(self) -> None:
        self._token = ""
        if not self._stack:
            self.done = True
            return
        self._expect = "comma_or_end"
        if len(self._stack) == 1 and self._top_key is not None:
            self.events.append(("end", self._top_key, ""))
            self._top_key = None

    def _end_number(self) -> None:
        if not _NUMBER.fullmatch(self._text):
            raise JsonError(f"bad number {self._text!r}")
        try:
            value = json.loads(self._text)
        except ValueError as e:  # more digits than int() allows
            raise JsonError(str(e)) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise JsonError(f"number out of range {self._text!r}")
        self._put(json.dumps(value))
        self._value_done()

    def _literal_char(self, ch: str) -> None:
        self._text += ch
        if self._text in _LITERALS:
            self._put(self._text)
            self._value_done()
        elif not any(word.startswith(self._text) for word in _LITERALS):
            raise JsonError(f"bad literal {self._text!r}")

    def _string_char(self, ch: str) -> None:
        if self._escape == "u":
            self._text += ch
            if ch not in _HEX:
                raise JsonError(f"bad \\u escape {self._text!r}")
            if len(self._text) == 4:
                self._escape = ""
                self._string_code(chr(int(self._text, 16)))
        elif self._escape:
            if ch not in _ESCAPES and ch != "u":
                raise JsonError(f"bad escape \\{ch}")
            self._escape, self._text = ("u", "") if ch == "u" else ("", "")
            if ch != "u":
                self._string_code(_ESCAPES[ch])
        elif ch == "\\":
            self._escape = "\\"
        elif ch == '"':
            if self._high:
                raise JsonError("lone surrogate")
            self._put('"')
            if self._is_key:
                self._token, self._expect = "", "colon"
            else:
                self._value_done()
        else:
            self._string_code(ch)

    def _string_code(self, ch: str) -> None:
        if self._high:
            if not "\udc00" <= ch <= "\udfff":
                raise JsonError("lone surrogate")
            ch = chr(0x10000 + ((ord(self._high) - 0xD800) << 10) + ord(ch) - 0xDC00)
            self._high = ""
        elif "\ud800" <= ch <= "\udbff":
            self._high = ch
            return
        elif "\udc00" <= ch <= "\udfff":
            raise JsonError("lone surrogate")
        if self._is_key:
            self._key += ch
        self._put(_DUMPED.get(ch, ch))
