"""Tool-call parsers as vLLM names them: `--tool-call-parser hermes|llama3_json|deepseek_v3`.

A parser reads a chat model's output for the tool calls it makes, either whole (`extract`) or while
it is decoded (`stream()`, fed the text deltas). Pure Python with no server dependency; the API
layer turns the results into OpenAI `tool_calls`.

The formats:
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` ("parameters" is taken
  too), one or more, content before them.
- llama3_json: the output is a JSON object `{"name": ..., "parameters": {...}}` ("arguments" is
  taken too), optionally after `<|python_tag|>`, several separated by `;`.
- deepseek_v3: `<｜tool▁calls▁begin｜>` then, per call,
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`,
  then `<｜tool▁calls▁end｜>` (DeepSeek-V3's full-width bars and ▁), content before them. As in
  vLLM, a text that ends after a complete call without `<｜tool▁calls▁end｜>` is accepted.

Common rules. Arguments must be a JSON object; they come back as the string
`json.dumps(arguments, ensure_ascii=False)` (a call with no arguments key gets "{}"). Content is the
text outside the markup as written, except that whitespace-only stretches next to the markup are
dropped; None if empty. Malformed tool output (bad JSON, no name, arguments that are not an object,
unterminated markup) is not an error: `extract` then returns `tools_called=False` with the whole
text as content. See `ToolCallStream` for what streaming does in that case.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpjax.serve.tools.streaming import DeltaMessage, Grammar, ToolCall, ToolCallStream

__all__ = ["PARSERS", "DeltaMessage", "ExtractedToolCalls", "ToolCall", "ToolCallStream", "ToolParser",
           "get_tool_parser"]


@dataclass
class ExtractedToolCalls:
    """The calls in a whole output, and the text outside them (None if empty)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


class ToolParser:
    """A tool-call format. Stateless: every `stream()` is a fresh reader."""

    name: str = ""
    grammar: Grammar

    def stream(self) -> ToolCallStream:
        """A reader for one output decoded in pieces: `feed(delta_text)` for each, then `finish()`."""
        return ToolCallStream(self.grammar)

    call_open: str = ""  # a call's text before its function name
    args_open: str = ""  # between the name and the arguments object

    def call_prefix(self, name: str | None) -> str:
        """The opening of a call in this format, up to where the arguments begin (with `name`) or
        up to the name (without): written into the assistant turn for tool_choice "required" or
        a named function, so that the model continues a call."""
        return self.call_open + (name + self.args_open if name else "")

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output; malformed tool output gives the whole text back as content."""
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        if stream.malformed or not stream.calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=text or None)
        content = "".join(d.content for d in deltas if d.content is not None)
        return ExtractedToolCalls(tools_called=True, tool_calls=list(stream.calls), content=content or None)


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro, Qwen 2.5 / 3)."""

    name = "hermes"
    call_open, args_open = '<tool_call>\n{"name": "', '", "arguments": '
    grammar = Grammar(
        markers={"<tool_call>": "call"},
        sequences={
            "text": (("text",),),
            "call": (("call",), ("json", "call"), ("lit", "</tool_call>"), ("end",), ("text",)),
        },
    )


class Llama3JsonToolParser(ToolParser):
    """A whole output of `{"name": ..., "parameters": {...}}` objects joined by `;` (Llama 3.1 / 3.2)."""

    name = "llama3_json"
    call_open, args_open = '{"name": "', '", "parameters": '
    _next = ("choice", ((";", "call", True),), "text")
    grammar = Grammar(
        start="start",
        sequences={
            "start": (("choice", (("<|python_tag|>", "call", True), ("{", "call", False)), "plain"),),
            "call": (("call",), ("json", "call"), ("end",), _next),
        },
    )


CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3's `<｜tool▁calls▁begin｜>` blocks, each call's arguments in a ```json fence."""

    name = "deepseek_v3"
    call_open, args_open = f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}", "\n```json\n"
    _call = (
        ("call",), ("until", TOOL_SEP, "type"), ("until", "\n", "name"), ("lit", "```json"), ("json", "args"),
        ("lit", "```"), ("lit", CALL_END), ("end",),
        ("choice", ((CALL_BEGIN, "call", True), (CALLS_END, "text", True)), "end"),
    )
    grammar = Grammar(
        markers={CALLS_BEGIN: "block"},
        sequences={"text": (("text",),), "block": (("lit", CALL_BEGIN), *_call), "call": _call},
    )


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, DeepSeekV3ToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser `--tool-call-parser NAME` selects; ValueError naming the valid ones otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
