"""The tokenizer a GGUF file carries, rebuilt with Hugging Face `tokenizers`.

A GGUF file stores its tokenizer as metadata: `tokenizer.ggml.model` ("gpt2" is byte-level
BPE, "llama" a SentencePiece vocabulary), `.tokens`, `.scores`, `.merges`, `.token_type`
(1 normal, 3 control, 4 user-defined, 6 byte), the special token ids, `.add_bos_token`, `.pre`
(which pre-tokenizer split the text before BPE) and `tokenizer.chat_template`.

Byte-level BPE ("gpt2"): control and user-defined tokens are matched whole, before BPE. The
splitting regexes are those llama.cpp's `llama-vocab.cpp` applies for each `.pre` name, its
four-regex fallback included for "default" (what the converter writes for a tokenizer it does
not recognise, so the original's exact splitting is unknown: dcpjax splits as llama.cpp does).
Not rebuilt: a Unicode normalizer (Qwen2's NFC), so text in decomposed form may tokenize
differently.

SentencePiece BPE ("llama"), for Gemma's files only (`general.architecture` gemma, gemma2,
gemma3; checked on Gemma 3 270M's, whose ids equal transformers' on the texts of
tests/fixtures/gemma3): rebuilt as transformers rebuilds it (`GemmaTokenizer`), which is what
dcpjax is held to. Spaces become "\u2581" (no prefix space: the file's `add_space_prefix` is
false), the text between added tokens is one BPE word, unknown characters fall back to their
UTF-8 byte tokens (`<0xNN>`), and decoding turns "\u2581" back into spaces. The file has no
merges: they are every split of a token into two tokens, ranked by the token's place in the
vocabulary, longer left part first (the normal tokens' `.scores` fall in that order, so
llama.cpp, which merges by score, ranks them alike). Control tokens are special and
user-defined ones plain added tokens, both matched whole; the file spells its whitespace-run
tokens with real spaces ("  "), renamed "\u2581\u2581" so that BPE reaches them. BOS is added
(`add_bos_token`) even before a literal `<bos>` in the text, as transformers does (and
llama.cpp, with a warning). Where llama.cpp differs (its own SentencePiece code, not run
here): it matches the user-defined space runs whole in the raw text rather than through BPE,
and it reads control tokens in the text only when asked to parse special tokens
(transformers and dcpjax always do).

A gemma3 file without `tokenizer.chat_template` (the base models') gets Gemma 3's own template
(`GEMMA3_CHAT_TEMPLATE`, from google/gemma-3-*-it's tokenizer_config.json), so chat requests
render the turns the instruction-tuned models were trained on.
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
SENTENCEPIECE_BPE = ("gemma", "gemma2", "gemma3")  # architectures whose "llama" vocabulary is rebuilt
# google/gemma-3-*-it tokenizer_config.json's chat_template, for a gemma3 GGUF that carries none: a system message
# becomes the first user turn's opening paragraph; "assistant" is "model"; text parts only ("image" parts write
# <start_of_image>); the template writes <bos> itself (chat prompts are encoded without special tokens)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n"
)
DEFAULT_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}  # general.architecture -> template, if the file has none
SPACE = "\u2581"  # SentencePiece's visible space
_SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}


def gguf_tokenizer(meta: dict[str, Any], path: str) -> HFTokenizer:
    """An `HFTokenizer` from a GGUF file's metadata (`dcpjax.loader.gguf_loader.GGUFFile.meta`).

    Raises ValueError for a tokenizer model or pre-tokenizer this does not rebuild, naming
    the way out (`tokenizer=` a Hugging Face folder).
    """
    from tokenizers import AddedToken, processors

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre") or "default"
    architecture = meta.get("general.architecture")
    way_out = "pass tokenizer= (--tokenizer) a Hugging Face folder with the model's tokenizer.json"
    if kind not in ("gpt2", "llama") or (kind == "llama" and architecture not in SENTENCEPIECE_BPE):
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported for architecture {architecture!r} "
                         f"(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece, for "
                         f"{', '.join(SENTENCEPIECE_BPE)}); " + way_out)
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(PRE_TOKENIZERS)}); " + way_out)
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{path}: GGUF tokenizer metadata has no tokenizer.ggml.tokens; " + way_out)
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokenizer, spelled = _byte_level_bpe(tokens, meta, pre) if kind == "gpt2" else _sentencepiece_bpe(tokens, meta)
    types = list(meta.get("tokenizer.ggml.token_type", []))
    # added tokens, matched whole in the text; a user-defined token the vocabulary spells otherwise (Gemma's
    # whitespace runs) is left to BPE, as transformers leaves it
    added = [AddedToken(tokens[i], special=t == CONTROL, normalized=False) for i, t in enumerate(types)
             if t == CONTROL or t == USER_DEFINED and spelled[i] == tokens[i]]
    tokenizer.add_special_tokens([a for a in added if a.special])
    tokenizer.add_tokens([a for a in added if not a.special])
    config = {key: tokens[int(meta[f"tokenizer.ggml.{field}"])] for key, field in _SPECIALS.items()
              if meta.get(f"tokenizer.ggml.{field}") is not None and int(meta[f"tokenizer.ggml.{field}"]) < len(tokens)}
    # a SentencePiece vocabulary gets BOS unless the file says otherwise (llama.cpp's and transformers' rule)
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or pre in ADD_BOS))
    if kind == "llama" and config["add_bos_token"] and "bos_token" in config:
        bos = config["bos_token"]  # added by the tokenizer itself, as transformers' post-processor does
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, int(meta["tokenizer.ggml.bos_token_id"]))])
    template = meta.get("tokenizer.chat_template") or DEFAULT_CHAT_TEMPLATES.get(architecture)
    if template:
        config["chat_template"] = template
    return HFTokenizer.from_parts(tokenizer, config)


def _byte_level_bpe(tokens: list[str], meta: dict[str, Any], pre: str):
    """("gpt2") byte-level BPE with the file's merges, split first by `pre`'s regexes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                     ignore_merges=pre in IGNORE_MERGES)
    tokenizer = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, tokens


def _sentencepiece_bpe(tokens: list[str], meta: dict[str, Any]):
    """("llama", Gemma) SentencePiece BPE: merges rebuilt from the vocabulary's order (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    spelled = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]  # "  " -> "\u2581\u2581"
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = []
    for token in spelled:  # in vocabulary order: the merge rank
        for cut in range(len(token) - 1, 0, -1):  # longer left part first
            if token[:cut] in vocab and token[cut:] in vocab:
                merges.append((token[:cut], token[cut:]))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab, merges, unk_token=spelled[int(unk)] if unk is not None else None, fuse_unk=True,
                     byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer, spelled
