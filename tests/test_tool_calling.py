"""Tool calling through /v1/chat/completions: tools reach the template, the output is parsed into
tool_calls (whole and streamed, with the official client), malformed output stays content,
and choices this server cannot honour are clear 400s.

The route is tested in-process with a scripted engine (it "generates" a given text in
pieces): the model's output is the input here; the parsers are tested on their own in
test_tool_parsers.py and the real engine everywhere else.
"""

import json

import openai
import pytest
from fastapi.testclient import TestClient

from dcpjax import LLM
from dcpjax.serve.api import build_app
from dcpjax.serve.async_engine import Update
from dcpjax.serve.metrics import Metrics
from dcpjax.serve.tools.calls import ToolConfig

MODEL = "tiny"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
            "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CALL = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


class ScriptedEngine:
    """An AsyncEngine stand-in: every request's output is `script`, sent in `pieces` parts."""

    def __init__(self, script: str, pieces: int = 7):
        self.script, self.pieces = script, pieces

    async def generate(self, seq):
        step = max(1, len(self.script) // self.pieces)
        parts = [self.script[i : i + step] for i in range(0, len(self.script), step)]
        seq.text = ""
        for n, part in enumerate(parts):
            seq.text += part
            last = n == len(parts) - 1
            if last:
                seq.finish_reason = "stop"
            yield Update(part, [], [], seq.finish_reason if last else None, seq)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_model_len=512, kv_cache_memory_bytes=1 << 20)


HERMES = ToolConfig(True, "hermes")


def make_client(llm, script, tools=HERMES):
    app = build_app(llm, ScriptedEngine(script), Metrics(MODEL), served_model_name=MODEL, chat_template=TEMPLATE,
                    tools=tools)
    return TestClient(app)


def openai_client(test_client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=test_client)


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Zürich?"}], "tools": TOOLS, **kw}


def test_tool_call_parsed_whole_and_streamed(llm):
    with make_client(llm, CALL) as test_client:
        client = openai_client(test_client)
        out = client.chat.completions.create(**chat())
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Zürich"}
        stream = list(client.chat.completions.create(stream=True, **chat()))
        content = "".join(c.choices[0].delta.content or "" for c in stream)
        deltas = [d for c in stream for d in (c.choices[0].delta.tool_calls or [])]
        assert content == "Let me check." and deltas[0].function.name == "get_weather" and deltas[0].id
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Zürich"}
        assert stream[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_call_and_tool_choice_none_stay_content(llm):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    with make_client(llm, broken) as test_client:
        out = openai_client(test_client).chat.completions.create(**chat())
        assert out.choices[0].message.content == broken and out.choices[0].finish_reason == "stop"
        assert out.choices[0].message.tool_calls is None
    with make_client(llm, CALL) as test_client:
        out = openai_client(test_client).chat.completions.create(**chat(tool_choice="none"))
        assert out.choices[0].message.content == CALL and out.choices[0].finish_reason == "stop"


def test_tools_reach_the_template(llm):
    with make_client(llm, CALL) as test_client:
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        ids = test_client.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
        text = test_client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text.startswith("<tools>get_weather;</tools><|user|>hi<|assistant|>[")  # (trim_blocks eats the \n)
        assert '"tool_calls"' not in text and '"function"' in text and "<|tool|>sunny" in text


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice, script", [
    (NAMED, '{"city": "Paris"}}\n</tool_call>'),
    ("required", 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
])
def test_required_and_named_open_the_call(llm, tool_choice, script):
    """The call's opening (with the name when named) starts the assistant turn; the model writes the rest."""
    engine_prompts = []
    with make_client(llm, script, ToolConfig(False, "hermes")) as test_client:
        client = openai_client(test_client)
        original = ScriptedEngine.generate

        async def recording(self, seq):
            engine_prompts.append(seq.prompt)
            async for update in original(self, seq):
                yield update

        ScriptedEngine.generate = recording
        try:
            out = client.chat.completions.create(**chat(tool_choice=tool_choice))
            stream = list(client.chat.completions.create(stream=True, **chat(tool_choice=tool_choice)))
        finally:
            ScriptedEngine.generate = original
    opening = '<tool_call>\n{"name": "' + ('get_weather", "arguments": ' if tool_choice == NAMED else "")
    assert engine_prompts[0].endswith("<|assistant|>" + opening)
    [call] = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    deltas = [d for c in stream for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}


def test_a_required_call_the_model_breaks_stays_content(llm):
    with make_client(llm, "no JSON here", ToolConfig(False, "hermes")) as test_client:
        out = openai_client(test_client).chat.completions.create(**chat(tool_choice=NAMED))
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == '<tool_call>\n{"name": "get_weather", "arguments": no JSON here'


@pytest.mark.parametrize("tools, body, fragment", [
    (ToolConfig(), chat(), "--enable-auto-tool-choice"),
    (ToolConfig(), chat(tool_choice="required"), "--tool-call-parser"),
    (HERMES, chat(tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (HERMES, {**chat(tool_choice="auto"), "tools": None}, "needs tools"),
])
def test_tool_choices_the_server_cannot_honour_are_400s(llm, tools, body, fragment):
    with make_client(llm, CALL, tools) as test_client:
        r = test_client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert fragment in r.json()["error"]["message"]


def test_tool_flags_are_checked():
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolConfig(True, None)
    with pytest.raises(ValueError, match="hermes"):
        ToolConfig(False, "nope")
