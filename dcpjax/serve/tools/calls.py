"""Tool calling in /v1/chat/completions, as vLLM does it.

The request's `tools` go to the chat template (which writes them into the prompt in the
model's own format). With `tool_choice` "auto" (the default when tools are given) the
server needs `--enable-auto-tool-choice --tool-call-parser NAME`: the model's output is
parsed (`parsers`) into `message.tool_calls` and `finish_reason: "tool_calls"`, in
streamed deltas too; output that is not a well-formed call stays plain content. "none"
renders the tools but never parses.

"required" and a named function (they need `--tool-call-parser`) open the call for the
model: the format's call prefix (with the function's name when named) is written at the
start of the assistant turn, so the model continues a call and writes its arguments.
vLLM instead constrains decoding to the tool's JSON schema; this server has no
constrained decoding, so arguments that do not parse leave the output as plain content
(finish_reason "stop"), as for any malformed call.
"""

from __future__ import annotations

import dataclasses

from dcpjax.serve.errors import APIError
from dcpjax.serve.tools.parsers import ToolParser, get_tool_parser


@dataclasses.dataclass(frozen=True)
class ToolConfig:
    """The server's tool-calling flags."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or deepseek_v3)")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming the valid parsers

    def parser_for(self, body) -> tuple[ToolParser | None, str]:
        """The parser for this request's output (None: plain content) and the text that opens
        the assistant turn ("" unless a call is required), or a 400 naming what is missing."""
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if choice == "none":
            return None, ""
        if not body.tools:
            raise APIError(400, "tool_choice other than 'none' needs tools", param="tool_choice")
        if choice == "auto":
            if not self.enable_auto_tool_choice:
                raise APIError(400, '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                               "and --tool-call-parser", param="tool_choice")
            return get_tool_parser(self.tool_call_parser), ""
        if self.tool_call_parser is None:
            raise APIError(400, "tool_choice 'required' or a named function requires the server to run with "
                           "--tool-call-parser (the model's call format)", param="tool_choice")
        name = None if choice == "required" else choice.function.name
        if name is not None and name not in {tool.function.name for tool in body.tools}:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        parser = get_tool_parser(self.tool_call_parser)
        return parser, parser.call_prefix(name)


def tool_definitions(body) -> list[dict] | None:
    """The request's tools as the template takes them (JSON-schema dicts)."""
    return None if not body.tools else [tool.model_dump(exclude_none=True) for tool in body.tools]


def parsed_message(parser: ToolParser | None, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a whole output, and its finish_reason ("tool_calls" if it called one)."""
    if parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    extracted = parser.extract(text)
    if not extracted.tools_called:
        return {"role": "assistant", "content": text}, finish_reason
    calls = [call.to_dict() for call in extracted.tool_calls]
    return {"role": "assistant", "content": extracted.content, "tool_calls": calls}, "tool_calls"


class StreamedToolCalls:
    """One choice's stream through the parser: text deltas in, OpenAI deltas out. `opening`:
    the text written at the start of the assistant turn (part of the output the parser reads)."""

    def __init__(self, parser: ToolParser | None, opening: str = ""):
        self.stream = None if parser is None else parser.stream()
        self.pending = opening

    def deltas(self, text: str, finished: bool) -> list[dict]:
        """The deltas for a piece of output text (all of them flushed when `finished`)."""
        text, self.pending = self.pending + text, ""
        if self.stream is None:
            return [{"content": text}]
        messages = self.stream.feed(text) if text else []
        if finished:
            messages += self.stream.finish()
        return [m.to_dict() for m in messages]

    def finish_reason(self, reason: str | None) -> str | None:
        if reason is not None and self.stream is not None and self.stream.tools_called:
            return "tool_calls"
        return reason
