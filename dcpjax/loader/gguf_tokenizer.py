"""The tokenizer a GGUF file carries, rebuilt with Hugging Face `tokenizers`.

A GGUF file stores its tokenizer as metadata: `tokenizer.ggml.model` ("gpt2" is byte-level
BPE), `.tokens`, `.merges`, `.token_type` (3 = control, 4 = user-defined: both are matched
whole, before BPE), the special token ids, `.add_bos_token`, `.pre` (which pre-tokenizer
split the text before BPE) and `tokenizer.chat_template`. The splitting regexes are those
llama.cpp's `llama-vocab.cpp` applies for each `.pre` name, its four-regex fallback included
for "default" (what the converter writes for a tokenizer it does not recognise, so the
original's exact splitting is unknown: dcpjax splits as llama.cpp does). Not rebuilt: a
Unicode normalizer (Qwen2's NFC), so text in decomposed form may tokenize differently.
"""

from __future__ import annotations

from typing import Any

from dcpjax.text.tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
# tokenizer.ggml.pre -> the regexes applied in turn (each match isolated), then byte-level BPE
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT, "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,),
}
IGNORE_MERGES = ("llama-bpe", "llama3")  # Llama 3's tokenizer takes a whole-word vocabulary hit first
ADD_BOS = ("llama-bpe", "llama3")  # llama.cpp adds BOS for these when the file does not say
_SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}


def gguf_tokenizer(meta: dict[str, Any], path: str) -> HFTokenizer:
    """An `HFTokenizer` from a GGUF file's metadata (`dcpjax.loader.gguf_loader.GGUFFile.meta`).

    Raises ValueError for a tokenizer model or pre-tokenizer this does not rebuild, naming
    the way out (`tokenizer=` a Hugging Face folder).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre") or "default"
    way_out = "pass tokenizer= (--tokenizer) a Hugging Face folder with the model's tokenizer.json"
    if kind != "gpt2":
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2', byte-level BPE); "
                         + way_out)
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(PRE_TOKENIZERS)}); " + way_out)
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{path}: GGUF tokenizer metadata has no tokenizer.ggml.tokens; " + way_out)
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                     ignore_merges=pre in IGNORE_MERGES)
    tokenizer = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    added = [AddedToken(tokens[i], special=t == CONTROL, normalized=False)
             for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    tokenizer.add_special_tokens([a for a in added if a.special])
    tokenizer.add_tokens([a for a in added if not a.special])
    config = {key: tokens[int(meta[f"tokenizer.ggml.{field}"])] for key, field in _SPECIALS.items()
              if meta.get(f"tokenizer.ggml.{field}") is not None and int(meta[f"tokenizer.ggml.{field}"]) < len(tokens)}
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", pre in ADD_BOS))
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return HFTokenizer.from_parts(tokenizer, config)
