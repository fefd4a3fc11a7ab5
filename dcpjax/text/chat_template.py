"""Chat prompts: the model's `chat_template` rendered exactly as transformers' `apply_chat_template` renders it.

The jinja environment is the one transformers builds (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls,
a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`), and the template sees the same
variables: `messages`, `tools` (JSON-schema dicts), `documents`, `add_generation_prompt`, the tokenizer's named
special tokens (`bos_token`, `eos_token`, ...) and any `chat_template_kwargs` (`enable_thinking`, ...).
"""

from __future__ import annotations

import codecs
import dataclasses
import datetime
import json
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils
import numpy as np

# For models without a template (the built-in tiny ones): plain role-tagged turns.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# transformers' `special_tokens_map`: the named special tokens every template may read.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning goes by; templates read `reasoning_content` (gpt-oss ones `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables `render` sets itself; chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_JINJA_CHARS = "{}\n"  # vLLM's test for "this --chat-template is a template, not a path"


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """A template that does not compile, calls `raise_exception`, or cannot take this conversation."""


def _now() -> datetime.datetime:
    return datetime.datetime.now()  # noqa: DTZ005 -- local time, naive, as transformers


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return _now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps (jinja's own escapes <, >, & and ')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _check_attribute(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()` without underscore-prefixed attributes (as in transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature: namespace(self=1) works
        self, attributes = args[0], dict(*args[1:], **kwargs)
        for name in attributes:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name)
        super().__setitem__(name, value)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it): renders its body."""

    tags = {"generation"}  # noqa: RUF012 -- jinja's class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The jinja environment transformers renders chat templates in."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


def load_chat_template(value: str) -> str:
    """A `--chat-template` value as vLLM reads it: a file's text, else (if it looks like jinja) the text itself,
    with backslash escapes such as \\n decoded."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as err:
        if not any(c in value for c in _JINJA_CHARS):
            raise ChatTemplateError(f"--chat-template {value!r} looks like a file path, but it cannot be read: "
                                    f"{err}") from err
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


def text_content(content: Any) -> str | None:
    """A message's content as template input: a string as it is, the text parts of a multi-part
    content joined (OpenAI's [{"type": "text", "text": ...}, ...], dicts or objects), None as None
    (an assistant turn with only tool_calls: the template sees no content, as in transformers)."""
    if content is None or isinstance(content, str):
        return content
    part = lambda p, key: p.get(key) if isinstance(p, Mapping) else getattr(p, key, None)
    return "".join(part(p, "text") or "" for p in content if part(p, "type") == "text")


class ChatTemplate:
    """The model's chat template (tokenizer_config.json), or `chat_template`: a file path, an inline template, or
    the name of one of the model's named templates."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        config = getattr(tokenizer, "config", None) or {}
        named = config.get("chat_template")
        if isinstance(named, list):  # several named templates: [{"name", "template"}, ...]
            named = {t["name"]: t["template"] for t in named}
        if chat_template is not None:
            if isinstance(named, dict) and chat_template in named:
                named = named[chat_template]
            else:
                named = load_chat_template(chat_template)
        self.sources: dict[str, str] | str = named or DEFAULT_CHAT_TEMPLATE
        env = make_environment()
        sources = self.sources if isinstance(self.sources, dict) else {"": self.sources}
        self.templates = {name: _compile(env, name, source) for name, source in sources.items()}
        self.special = {key: _token_text(config[key]) for key in SPECIAL_TOKENS if config.get(key) is not None}

    def select(self, tools: list | None = None) -> tuple[str, jinja2.Template]:
        """The template transformers would pick: the only one, else `tool_use` when tools are given, else
        `default`. Returns (source, compiled)."""
        if isinstance(self.sources, str):
            return self.sources, self.templates[""]
        for name in (("tool_use",) if tools is not None else ()) + ("default",):
            if name in self.sources:
                return self.sources[name], self.templates[name]
        raise ChatTemplateError(f"this model has several chat templates ({', '.join(sorted(self.sources))}) and "
                                "none named 'default': choose one with --chat-template NAME")

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool | str = False,
               chat_template_kwargs: dict | None = None) -> str:
        """The prompt text for these messages, as `apply_chat_template(..., tokenize=False)` returns it.

        `continue_final_message` (True, or the name of the message field to continue) leaves the final message
        open so that the model continues it."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set: continue "
                                    "the final message, or start a new assistant message after it")
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        source, template = self.select(tools)
        variables = {**self.special, **_template_kwargs(chat_template_kwargs)}
        chat = _prepare_messages(messages)
        final = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final = _mark_final_message(chat, field, source)
        text = template.render(messages=chat, tools=_plain(_check_dicts(tools, "tools")),
                               documents=_plain(_check_dicts(documents, "documents")),
                               add_generation_prompt=add_generation_prompt, **variables)
        return text if final is None else _cut_after_final_message(text, final)


def _compile(env: jinja2.Environment, name: str, source: str) -> jinja2.Template:
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        which = f"chat template {name!r}" if name else "chat template"
        raise ChatTemplateError(f"{which} does not compile: line {err.lineno}: {err.message}") from err


def _token_text(token: Any) -> str:
    return token.get("content", "") if isinstance(token, dict) else str(token)


def _template_kwargs(kwargs: Mapping | None) -> dict:
    kwargs = dict(kwargs or {})
    clash = sorted(RESERVED_VARIABLES & set(kwargs))
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(clash)}: pass them as request fields")
    return _plain(kwargs)


def _check_dicts(items: list | None, what: str) -> list | None:
    if items is not None and not all(isinstance(item, Mapping) for item in items):
        raise ChatTemplateError(f"{what} must be a list of JSON objects"
                                + (' ({"type": "function", "function": {...}})' if what == "tools" else ""))
    return items


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types (what transformers lets a template see); anything else is "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, base):
            return getattr(base, f"__{base.__name__}__")(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):  # np.bool_ would otherwise become a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: list) -> list[dict]:
    """transformers' preparation: keys whose value is None dropped, plain copies, reasoning under every name."""
    chat = []
    for message in messages:
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be JSON objects, got {message!r}")
        message = _plain({key: value for key, value in message.items() if value is not None})
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _mark_final_message(chat: list[dict], field: str, source: str) -> str:
    """Append a tag to the final message's `field` (its last text block for a list), so that the rendered text
    can be cut where that field ends. Returns the field's text."""
    final = chat[-1].get(field)
    if final is None:
        raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [key for key in REASONING_FIELDS if chat[-1].get(key) == final] if field in REASONING_FIELDS else [field]
    if not any(key in source for key in fields):
        raise ChatTemplateError(f'continue_final_message: the chat template never reads the "{field}" field')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return final
        raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
    for key in fields:
        chat[-1][key] = chat[-1][key] + _CONTINUE_TAG
    return final


def _cut_after_final_message(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the chat template does not render the final "
                                "message as given (it drops or rewrites part of it), so it cannot be continued")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing spaces: trim where the cut lands too
