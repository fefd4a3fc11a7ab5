"""Chat templates rendered as transformers' `apply_chat_template` renders them, text and tokens.

Expectations come from tests/fixtures/make_chat_template_fixtures.py (transformers, not needed here); when
transformers is installed, `test_matches_transformers_live` renders every case with it again.
"""

import datetime
import importlib.util
import json
import pathlib

import jinja2
import pytest

from dcpjax.serve import __main__ as serve_main
from dcpjax.text import chat_template as chat
from dcpjax.text.chat_template import ChatTemplate, ChatTemplateError
from dcpjax.text.tokenizer import HFTokenizer, load_tokenizer

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
DATA = json.loads((FIXTURES / "chat_templates.json").read_text())
CASES = DATA["cases"]
IDS = [f"{i}-{c['template']}-{c['conversation']}" for i, c in enumerate(CASES)]
_spec = importlib.util.spec_from_file_location("make_chat_template_fixtures",
                                               FIXTURES / "make_chat_template_fixtures.py")
maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(maker)
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer_folders(tmp_path_factory):
    """One tokenizer folder (tokenizer.json + tokenizer_config.json) per template of the fixtures."""
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {name: maker.make_tokenizer_folder(root / name, config) for name, config in DATA["templates"].items()}


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):
    monkeypatch.setattr(chat, "_now", lambda: datetime.datetime.fromisoformat(DATA["now"]))


def render(folder, case):
    """dcpjax's rendering of one case: {"text", "token_ids"} or {"error"}."""
    tokenizer = HFTokenizer(folder)
    messages, kwargs = maker.case_inputs(case, DATA)
    try:
        text = ChatTemplate(tokenizer).render(messages, **kwargs)
    except ChatTemplateError as err:
        return {"error": str(err)}
    return {"text": text, "token_ids": tokenizer.encode(text, add_special_tokens=False)}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_transformers(case, tokenizer_folders):
    got = render(tokenizer_folders[case["template"]], case)
    if "error" in case:
        assert "error" in got, f"transformers failed ({case['error']}) but dcpjax rendered {got.get('text')!r}"
        if "TemplateError: " in case["error"]:  # raise_exception: the template's own words
            assert got["error"] == case["error"].split("TemplateError: ", 1)[1]
        return
    assert got == {"text": case["text"], "token_ids": case["token_ids"]}


def test_cases_cover_the_environment():
    """The fixtures exercise what transformers' environment adds (so the comparisons above mean something)."""
    sources = json.dumps(DATA["templates"])
    for feature in ("{%- break %}", "{%- continue %}", "namespace(", "tojson(indent=4)", "tojson(separators=",
                    "ensure_ascii=true", "strftime_now(", "raise_exception(", "enable_thinking", "documents",
                    "dict.fromkeys", "loop.previtem", "tool_calls", "{% generation %}"):
        assert feature in sources, feature
    texts = "".join(case.get("text", "") for case in CASES)
    assert '"Zürich <&>"' in texts and "\\u00b0C <or>" in texts and "26 Jul 2024" in texts  # no HTML escaping
    assert sum("error" in case for case in CASES) >= 5
    assert any(case["options"].get("continue_final_message") and "text" in case for case in CASES)


def test_matches_transformers_live(tokenizer_folders):
    pytest.importorskip("transformers")
    from dcpjax.text.chat_template import DEFAULT_CHAT_TEMPLATE

    for case, case_id in zip(CASES, IDS, strict=True):
        template = None if "chat_template" in DATA["templates"][case["template"]] else DEFAULT_CHAT_TEMPLATE
        expected = maker.render_with_transformers(tokenizer_folders[case["template"]], case, DATA, template)
        stored = {key: case[key] for key in ("text", "token_ids", "error") if key in case}
        assert expected == stored, f"{case_id}: transformers renders differently now; regenerate the fixtures"
        got = render(tokenizer_folders[case["template"]], case)
        assert ("error" in got) == ("error" in expected), case_id
        if "text" in expected:
            assert got == expected, case_id


def test_environment_matches_transformers():
    """The filters and globals transformers adds, with its signatures."""
    source = ("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(ensure_ascii=true, sort_keys=true) }}|"
              "{{ x | tojson(separators=(',', ':')) }}|{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}"
              "{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}|{{ strftime_now('%d.%m.%Y') }}")
    text = ChatTemplate(None, chat_template=source).render([{"x": 1}],
                                                           chat_template_kwargs={"x": {"b": "<é&>", "a": 1}})
    assert text.split("|") == ['{"b": "<é&>", "a": 1}', '{\n  "b": "<é&>",\n  "a": 1\n}',
                               '{"a": 1, "b": "<\\u00e9&>"}', '{"b":"<é&>","a":1}', "02", "26.07.2024"]


def test_namespace_and_dict_are_sandboxed():
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        ChatTemplate(None, chat_template="{% set ns = namespace(_x=1) %}").render(USER)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate(None, chat_template="{{ dict.__class__.__mro__ }}").render(USER)


def test_chat_template_argument_is_a_file_an_inline_template_or_a_name(tmp_path, tokenizer_folders):
    path = tmp_path / "t.jinja"
    path.write_text("FILE {{ messages[0].content }}")
    assert ChatTemplate(None, chat_template=str(path)).render(USER) == "FILE hi"
    assert ChatTemplate(None, chat_template="INLINE {{ messages[0].content }}").render(USER) == "INLINE hi"
    assert ChatTemplate(None, chat_template=r"A\nB{{ '' }}").render(USER) == "A\nB"  # vLLM decodes escapes
    with pytest.raises(ChatTemplateError, match="looks like a file path"):
        ChatTemplate(None, chat_template=str(tmp_path / "missing.jinja"))
    tokenizer = HFTokenizer(tokenizer_folders["named"])  # named templates: pick one by name
    assert ChatTemplate(tokenizer, chat_template="tool_use").render(USER, tools=[]) == "<s>user: hi\nassistant:"
    assert ChatTemplate(tokenizer).render(USER, tools=[]) == ChatTemplate(tokenizer, "tool_use").render(USER, tools=[])
    assert ChatTemplate(tokenizer).render(USER).startswith("<s>\n<｜User｜>hi")


def test_serve_accepts_chat_template_flag(tmp_path):
    assert serve_main.parse_args([]).chat_template is None
    assert serve_main.parse_args(["--chat-template", str(tmp_path / "t.jinja")]).chat_template == str(
        tmp_path / "t.jinja")


def test_models_without_a_template_use_the_default():
    assert ChatTemplate(load_tokenizer(None)).render(USER) == "<|user|>\nhi\n<|assistant|>\n"
    assert ChatTemplate(None).render(USER, add_generation_prompt=False) == "<|user|>\nhi\n"


def test_bad_templates_and_raise_exception_are_clear_errors(tokenizer_folders):
    with pytest.raises(ChatTemplateError, match=r"does not compile: line 1: .*endfor"):
        ChatTemplate(None, chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="^roles must alternate$") as info:
        ChatTemplate(None, chat_template="{{ raise_exception('roles must alternate') }}").render(USER)
    assert isinstance(info.value, (jinja2.TemplateError, ValueError))  # the API's `except Exception` -> 400
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        ChatTemplate(None).render(USER, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ChatTemplate(None).render([])
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs cannot set messages"):
        ChatTemplate(None).render(USER, chat_template_kwargs={"messages": []})
    with pytest.raises(ChatTemplateError, match="tools must be a list of JSON objects"):
        ChatTemplate(None).render(USER, tools=["get_weather"])
    config = {"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}
    tokenizer = type("Tokenizer", (), {"config": config})()
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        ChatTemplate(tokenizer).render(USER)
    assert ChatTemplate(tokenizer, "b").render(USER) == "B"


def test_messages_are_not_modified():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel", "tool_calls": None}]
    before = json.dumps(messages)
    assert ChatTemplate(None).render(messages, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|assistant|>\nHel")
    assert json.dumps(messages) == before


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path, tokenizer_folders):
    """transformers reads chat_template.jinja before tokenizer_config.json's template; so do we."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tokenizer_folders["named"], folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert ChatTemplate(HFTokenizer(folder)).render([{"role": "user", "content": "hi"}]) == "[hi]"
