"""Tool-call parsers (hermes, llama3_json, deepseek_v3) on synthetic model outputs.

Whole-output extraction per format, then streaming: every output split in two at every character
boundary, and fed a character at a time, gives the calls and content that `extract` gives, in
OpenAI's delta form. The JSON re-writer behind streamed arguments is checked against json itself.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpjax.serve.tools.json_writer import JsonError, JsonObjectWriter
from dcpjax.serve.tools.parsers import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    PARSERS,
    TOOL_SEP,
    DeltaMessage,
    ToolCall,
    get_tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
UNICODE = {"city": "Zürich", "note": '日本語 "quoted" \\ and\nnew line', "emoji": "😀", "list": [1, 2.5, None, True]}


def hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def call_json(name, arguments, key="arguments") -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False)


def deepseek(*calls: tuple[str, str], sep: str = "\n") -> str:
    body = sep.join(f"{CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n{args}\n```{CALL_END}" for name, args in calls)
    return f"{CALLS_BEGIN}{body}{CALLS_END}"


# (parser, output, expected calls as (name, arguments dict), expected content)
WELL_FORMED = [
    ("hermes", hermes(call_json("get_weather", WEATHER)), [("get_weather", WEATHER)], None),
    ("hermes", "Let me look.\n" + hermes(call_json("get_weather", WEATHER)), [("get_weather", WEATHER)],
     "Let me look.\n"),
    ("hermes", hermes(call_json("a", {"x": 1})) + "\n" + hermes(call_json("b", {})) + "\n",
     [("a", {"x": 1}), ("b", {})], None),
    ("hermes", hermes(call_json("translate", UNICODE)), [("translate", UNICODE)], None),
    ("hermes", hermes('{"arguments":{"s":"\\u00e9\\ud83d\\ude00\\/\\t","n":[1.50,1e3,-0,false]},'
                      '"type":"x","name":"f"}'),
     [("f", {"s": "é😀/\t", "n": [1.5, 1000.0, 0, False]})], None),
    ("hermes", hermes('{"name": "get_time"}'), [("get_time", {})], None),
    ("hermes", hermes('{"name": "code", "arguments": {"src": "line one\nline two"}}'),
     [("code", {"src": "line one\nline two"})], None),
    ("hermes", "A\n" + hermes(call_json("f", {"k": "v"})) + "\nDone.", [("f", {"k": "v"})], "A\n\nDone."),
    ("hermes", "\n\n" + hermes(call_json("f", {})), [("f", {})], None),
    ("hermes", "The weather is nice.", [], "The weather is nice."),
    ("hermes", "a < b, <tool> and </tool_call> then <tool_cal", [], "a < b, <tool> and </tool_call> then <tool_cal"),
    ("hermes", "  \n", [], "  \n"),
    ("hermes", "", [], None),
    ("llama3_json", call_json("get_weather", WEATHER, "parameters"), [("get_weather", WEATHER)], None),
    ("llama3_json", "<|python_tag|>" + call_json("get_weather", WEATHER), [("get_weather", WEATHER)], None),
    ("llama3_json", call_json("a", {"x": [1]}, "parameters") + "; " + call_json("b", UNICODE, "parameters"),
     [("a", {"x": [1]}), ("b", UNICODE)], None),
    ("llama3_json", ' \n{"type": "function", "name": "f", "parameters": {}};{"name":"g","parameters":{"y":null}}',
     [("f", {}), ("g", {"y": None})], None),
    ("llama3_json", call_json("f", {}, "parameters") + "\nDone", [("f", {})], "\nDone"),
    ("llama3_json", "Paris is sunny.", [], "Paris is sunny."),
    ("llama3_json", "", [], None),
    ("deepseek_v3", deepseek(("get_weather", '{"location": "Beijing"}')), [("get_weather", {"location": "Beijing"})],
     None),
    ("deepseek_v3", "Checking.\n" + deepseek(("a", '{"x":1}'), ("b", "{}")), [("a", {"x": 1}), ("b", {})],
     "Checking.\n"),
    ("deepseek_v3", deepseek(("a", "{}"), ("b", json.dumps(UNICODE)), sep=""), [("a", {}), ("b", UNICODE)], None),
    ("deepseek_v3", deepseek(("translate", json.dumps(UNICODE, ensure_ascii=False, indent=2))),
     [("translate", UNICODE)], None),
    ("deepseek_v3", deepseek(("f", "{}")) + "\nDone.", [("f", {})], "\nDone."),
    ("deepseek_v3", "No tools needed.", [], "No tools needed."),
    ("deepseek_v3", CALLS_BEGIN + f"{CALL_BEGIN}function{TOOL_SEP}f\n```json\n{{}}\n```{CALL_END}\n", [("f", {})],
     None),  # no <｜tool▁calls▁end｜>: accepted, as vLLM does
]

MALFORMED = [
    ("hermes", hermes('{"name": "f", "arguments": {"a": 1,}}')),
    ("hermes", hermes('{"arguments": {"a": 1}}')),
    ("hermes", "Sure: " + hermes('{"name": "f", "arguments": "not an object"}')),
    ("hermes", hermes('{"name": 3, "arguments": {}}')),
    ("hermes", hermes('{"name": "f", "name": "g", "arguments": {}}')),
    ("hermes", hermes('{"name": "f", "arguments": {}} trailing')),
    ("hermes", "\n<tool_call>\n" + call_json("f", {})),  # no </tool_call>
    ("hermes", '<tool_call>\n{"name": "f", "argu'),  # cut off
    ("hermes", hermes("{'name': 'f', 'arguments': {}}")),
    ("llama3_json", '{"city": "Paris"}'),
    ("llama3_json", '{"name": "f", "parameters": {}, "arguments": {}}'),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")'),
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}'),
    ("deepseek_v3", CALLS_BEGIN + f"{CALL_BEGIN}function{TOOL_SEP}f\n```json\n{{}}\n```"),  # no call end
    ("deepseek_v3", "Hi" + deepseek(("f", '{"a": }'))),
    ("deepseek_v3", deepseek(("f", '{"a": 1}')).replace("```json\n", "")),
    ("deepseek_v3", deepseek((" ", "{}"))),
    ("deepseek_v3", deepseek(("f", "[1, 2]"))),
]


def run_stream(parser_name: str, pieces: list[str]):
    stream = get_tool_parser(parser_name).stream()
    deltas = [delta for piece in pieces for delta in stream.feed(piece)]
    return stream, deltas + stream.finish()


def summarize(deltas: list[DeltaMessage]):
    """(content or None, [(id, name, arguments)]), checking each delta has OpenAI's streaming shape."""
    content, calls = "", []
    for delta in deltas:
        assert (delta.content is None) != (delta.tool_calls is None)
        if delta.content is not None:
            assert delta.content
            content += delta.content
            continue
        (tool,) = delta.tool_calls
        if "id" in tool:
            assert (tool["index"] == len(calls) and tool["type"] == "function"
                    and tool["id"].startswith("chatcmpl-tool-"))
            assert set(tool) == {"index", "id", "type", "function"} and set(tool["function"]) == {"name"}
            calls.append([tool["id"], tool["function"]["name"], ""])
        else:
            assert set(tool) == {"index", "function"} and set(tool["function"]) == {"arguments"}
            assert tool["index"] == len(calls) - 1 and tool["function"]["arguments"]
            calls[-1][2] += tool["function"]["arguments"]
    return content or None, [tuple(call) for call in calls]


def splits(text: str):
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    yield list(text)


@pytest.mark.parametrize("parser_name,text,calls,content", WELL_FORMED)
def test_extract(parser_name, text, calls, content):
    result = get_tool_parser(parser_name).extract(text)
    assert result.tools_called == bool(calls)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls
    assert all(c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False) for c in result.tool_calls)
    assert result.content == content


@pytest.mark.parametrize("parser_name,text,calls,content", WELL_FORMED)
def test_streaming_matches_extract_at_every_split(parser_name, text, calls, content):
    expected = get_tool_parser(parser_name).extract(text)
    want = [(c.name, c.arguments) for c in expected.tool_calls]
    for pieces in splits(text):
        stream, deltas = run_stream(parser_name, pieces)
        got_content, got_calls = summarize(deltas)
        assert got_content == expected.content, pieces
        assert [(name, arguments) for _, name, arguments in got_calls] == want, pieces
        assert [(c.id, c.name, c.arguments) for c in stream.calls] == got_calls
        assert not stream.malformed and stream.tools_called == bool(calls)


@pytest.mark.parametrize("parser_name,text", MALFORMED)
def test_malformed_output_falls_back_to_content(parser_name, text):
    result = get_tool_parser(parser_name).extract(text)
    assert (result.tools_called, result.tool_calls, result.content) == (False, [], text)
    for pieces in splits(text):
        stream, deltas = run_stream(parser_name, pieces)
        assert stream.malformed and stream.calls == [] and summarize(deltas)[0] == text, pieces


LATER_MALFORMED = [  # (parser, text, the calls completed before it broke, the rest of the text)
    ("hermes", hermes(call_json("a", {"x": 1})) + "\n" + hermes('{"name": "b", "arguments": {"y": }}'), ["a"],
     "\n" + hermes('{"name": "b", "arguments": {"y": }}')),
    ("hermes", hermes(call_json("a", {})) + "<tool_call>" + call_json("b", {}), ["a"],
     "<tool_call>" + call_json("b", {})),
    ("llama3_json", call_json("a", {}, "parameters") + "; ", ["a"], "; "),
    ("llama3_json", call_json("a", {}, "parameters") + ';{"name": "b"', ["a"], ';{"name": "b"'),
    ("deepseek_v3", deepseek(("a", "{}"))[: -len(CALLS_END)] + "junk", ["a"], "junk"),
    ("deepseek_v3", deepseek(("a", "{}"), ("b", "{,}")), ["a"], "\n" + deepseek(("b", "{,}"))[len(CALLS_BEGIN):]),
]


@pytest.mark.parametrize("parser_name,text,completed,rest", LATER_MALFORMED)
def test_a_later_malformed_call_spoils_extract_but_not_the_streamed_calls_before_it(parser_name, text, completed, rest):
    result = get_tool_parser(parser_name).extract(text)
    assert (result.tools_called, result.content) == (False, text)
    for pieces in splits(text):
        stream, deltas = run_stream(parser_name, pieces)
        content, calls = summarize(deltas)
        assert stream.malformed and [c.name for c in stream.calls] == completed, pieces
        assert content == rest and [name for _, name, _ in calls[: len(completed)]] == completed, pieces


def test_possible_marker_is_held_back_until_known():
    stream = get_tool_parser("hermes").stream()
    assert [d.to_dict() for d in stream.feed("Hello <tool")] == [{"content": "Hello "}]
    assert [d.to_dict() for d in stream.feed("box> and <")] == [{"content": "<toolbox> and "}]
    assert stream.feed("tool_call") == []
    assert [d.to_dict() for d in stream.finish()] == [{"content": "<tool_call"}]
    stream = get_tool_parser("deepseek_v3").stream()
    assert [d.content for d in stream.feed("x" + CALLS_BEGIN[:5])] == ["x"]
    stream = get_tool_parser("llama3_json").stream()
    assert stream.feed(" <|pyth") == [] and stream.feed("on") == []
    assert [d.content for d in stream.feed("ic") + stream.finish()] == [" <|pythonic"]


def test_arguments_stream_before_the_call_closes():
    text = "Sure. " + hermes(call_json("search", {"query": "a long query " * 5}))
    stream = get_tool_parser("hermes").stream()
    deltas = [d for ch in text[: text.index("}}") + 1] for d in stream.feed(ch)]
    content, calls = summarize(deltas)
    assert content == "Sure. " and calls[0][1] == "search"
    assert calls[0][2].startswith('{"query": "a long query a long')
    assert sum(1 for d in deltas if d.tool_calls and "arguments" in d.tool_calls[0]["function"]) > 10
    assert stream.calls == []  # not complete until </tool_call>
    rest = stream.feed(text[text.index("}}") + 1:]) + stream.finish()
    arguments = json.dumps({"query": "a long query " * 5})
    assert summarize(deltas + rest)[1][0][2] == stream.calls[0].arguments == arguments


def test_deltas_and_calls_serialize_as_openai_does():
    call = ToolCall(id="chatcmpl-tool-1", name="f", arguments="{}")
    assert call.to_dict() == {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert DeltaMessage(content="hi").to_dict() == {"content": "hi"}


def test_get_tool_parser():
    assert set(PARSERS) == {"hermes", "llama3_json", "deepseek_v3"}
    assert all(get_tool_parser(name).name == name for name in PARSERS)
    with pytest.raises(ValueError, match="deepseek_v3, hermes, llama3_json"):
        get_tool_parser("mistral")


def rewrite(text: str, chunk: int = 0) -> str:
    writer = JsonObjectWriter()
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)] if chunk else [text]
    used = sum(writer.feed(piece) for piece in pieces)
    assert writer.done and used == len(text.rstrip(" \n"))
    return "".join(text for kind, _, text in writer.events if kind == "piece")


@pytest.mark.parametrize("text", [
    "{}", '{"a": []}', '{ "a" : { } , "b":[ [ ] , {} ] }',
    '{"n": [0, -0, 1.0, 1.50, 1e3, -2E-2, 1e+2, 12345678901234567890]}',
    '{"s": "\\"\\\\\\/\\b\\f\\n\\r\\t\\u0001\\u001F\\u007f\\u2028 é 😀 \\ud83d\\ude00"}', '{"raw": "tab\there\nnew"}',
    '{"t": true, "f": false, "z": null, "dup": 1, "dup": 2}', '{"\\u00e9": {"deep": [[[{"x": "y"}]]]}}',
])
def test_json_writer_matches_json_dumps(text):
    want = json.dumps(json.loads(text, strict=False), ensure_ascii=False)
    if '"dup"' in text:
        want = want.replace('"dup": 2', '"dup": 1, "dup": 2')
    assert rewrite(text) == rewrite(text, 1) == want


@pytest.mark.parametrize("text", [
    "[1]", '"s"', '{"a":}', '{"a":1,}', '{"a" 1}', '{"a":tru}', '{"a":NaN}', '{"a":Infinity}', '{"a":1e999}',
    '{"a":01}', '{"a":1.}', '{"a":"\\ud800"}', '{"a":"\\udc00x"}', '{"a":"\\x"}', '{"a":"\\u12G4"}', "{a:1}",
    '{"a":1 2}', '{"a":[1,]}', '{"a":-}',
])
def test_json_writer_rejects_what_json_rejects(text):
    for chunk in (0, 1):
        with pytest.raises(JsonError):
            rewrite(text + "}", chunk)


def test_json_writer_tags_pieces_with_their_top_level_key():
    writer = JsonObjectWriter()
    assert writer.feed('{"name": "f", "arguments": {"a": [1]}, "x": 2} tail') == 46
    by_key = {}
    for kind, key, text in writer.events:
        by_key.setdefault(key, []).append(text if kind == "piece" else "<end>")
    assert "".join(by_key["name"]) == '"f"<end>' and "".join(by_key["arguments"]) == '{"a": [1]}<end>'
    assert "".join(by_key["x"]) == "2<end>" and "".join(by_key[None]) == '{"name": , "arguments": , "x": }'


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=4), st.sampled_from([None, 0, 2]),
       st.booleans(), st.integers(1, 7))
def test_json_writer_matches_json_dumps_on_random_objects(value, indent, ascii_only, chunk):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert rewrite(text, chunk) == json.dumps(value, ensure_ascii=False)


PIECES = ["<tool_call>", "</tool_call>", "<tool", "<|python_tag|>", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END,
          TOOL_SEP, "function", "\n```json\n", "\n```", "```", '{"name": "f", "arguments": ', '{"name": "g"',
          '"parameters": ', "{", "}", "[", "]", '"a"', ": ", ", ", ";", "1", "é", " ", "\n", "x", "\\", '"']


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(WELL_FORMED), st.lists(st.tuples(st.floats(0, 1), st.sampled_from(["", *PIECES])), max_size=3),
       st.data())
def test_mutated_outputs_never_raise_and_stream_like_extract(sample, edits, data):
    """Well-formed outputs with pieces inserted or a character deleted ("") at random places, cut at random."""
    parser_name, text = sample[:2]
    for where, piece in edits:
        at = int(where * len(text))
        text = text[:at] + piece + text[at + (not piece):]
    result = get_tool_parser(parser_name).extract(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4)))
    stream, deltas = run_stream(parser_name, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    content, calls = summarize(deltas)
    if not stream.malformed:
        assert (content, [(c.name, c.arguments) for c in result.tool_calls]) == (result.content, [c[1:] for c in calls])
    elif not stream.calls:
        assert content == text and not result.tools_called
