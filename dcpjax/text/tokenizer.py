"""Tokenizers: a byte-level one for the built-in tiny models, Hugging Face's for folders."""

from __future__ import annotations

import json
import pathlib

from dcpjax.models.config import BYTE_BOS, BYTE_EOS


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS and EOS follow. Every text round-trips."""

    bos_token_id, eos_token_id = BYTE_BOS, BYTE_EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return {BYTE_BOS: "<bos>", BYTE_EOS: "<eos>"}.get(token_id) or self.decode([token_id])


class HFTokenizer:
    """`tokenizer.json` (tokenizers library) with the special tokens of `tokenizer_config.json`."""

    def __init__(self, folder: str | pathlib.Path):
        from tokenizers import Tokenizer

        folder = pathlib.Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        # transformers' order: chat_template.jinja, then chat_template.json, over tokenizer_config.json's
        if (folder / "chat_template.jinja").is_file():
            config["chat_template"] = (folder / "chat_template.jinja").read_text()
        elif (folder / "chat_template.json").is_file():
            config["chat_template"] = json.loads((folder / "chat_template.json").read_text())["chat_template"]
        self._setup(Tokenizer.from_file(str(folder / "tokenizer.json")), config)

    @classmethod
    def from_parts(cls, tokenizer, config: dict) -> HFTokenizer:
        """From a `tokenizers.Tokenizer` and a tokenizer_config.json-style dict (special tokens,
        add_bos_token, chat_template), as a GGUF file's metadata gives them."""
        self = cls.__new__(cls)
        self._setup(tokenizer, dict(config))
        return self

    def _setup(self, tokenizer, config: dict) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None

    def _special_id(self, key: str) -> int | None:
        token = self.config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def load_tokenizer(folder: str | pathlib.Path | None):
    """ByteTokenizer for built-in models (folder None); HFTokenizer if the folder has
    tokenizer.json; None otherwise (prompts must then be token ids)."""
    if folder is None:
        return ByteTokenizer()
    if (pathlib.Path(folder) / "tokenizer.json").is_file():
        return HFTokenizer(folder)
    return None


class _ByteStream:
    """Incremental UTF-8 decoding of byte-token ids: a character split across tokens waits."""

    def __init__(self):
        import codecs

        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        return self.decoder.decode(bytes([token_id])) if token_id < 256 else ""


class _HFStream:
    """tokenizers' DecodeStream: text appears as soon as it can no longer change.

    DecodeStream raises "Invalid prefix encountered" when decoding stops being monotonic
    (byte-fallback tokens forming invalid UTF-8, say); the stream then restarts from the
    last few tokens as context, as vLLM does, instead of failing the request."""

    CONTEXT = 6

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.stream = self._new_stream(None)

    @staticmethod
    def _new_stream(ids):
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=ids, skip_special_tokens=True) if ids else DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.tokenizer, token_id)
        except Exception as err:  # tokenizers raises a bare Exception here
            if "Invalid prefix encountered" not in str(err):
                raise
            self.stream = self._new_stream(self.ids[-self.CONTEXT :])
            text = self.stream.step(self.tokenizer, token_id)
        self.ids.append(token_id)
        return text or ""


def decode_stream(tokenizer):
    """An object whose `step(token_id) -> str` returns the text each new token adds (O(1) per
    token); the concatenation is the text so far. None without a tokenizer."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, HFTokenizer):
        return _HFStream(tokenizer.tokenizer)
    return _ByteStream()


def eos_token_ids(model_eos: list[int], tokenizer) -> set[int]:
    """The tokens that end a sequence: the model config's, and the tokenizer's own (if it has one)."""
    eos = set(model_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos
