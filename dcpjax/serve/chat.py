"""Chat prompts: the model's `chat_template` (tokenizer_config.json) rendered with jinja2."""

from __future__ import annotations

import jinja2
import jinja2.sandbox

# For models without a template (the built-in tiny ones): plain role-tagged turns.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _raise(message):
    raise jinja2.TemplateError(message)


class ChatTemplate:
    def __init__(self, tokenizer):
        config = getattr(tokenizer, "config", {}) or {}
        source = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        if isinstance(source, list):  # several named templates: take the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), source[0]["template"])
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
