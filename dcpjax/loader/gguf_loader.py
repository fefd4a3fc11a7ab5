"""GGUF files (llama.cpp's format) as a dcpjax model: config, weights and tokenizer.

Read with the `gguf` package (llama.cpp's own reader): `GGUFReader` maps the file,
`gguf.quants.dequantize` turns any quantization type it supports into float32. The
tensors are exposed under their Hugging Face names and shapes (`GGUFSource`), so the
same `rules.model_rules` load them as they load safetensors, each device reading
only its slice: a slice of whole rows is cut from the file before dequantizing (a
quantization block never spans two rows); a slice of columns needs the whole row.

Which GGUF architectures are read, as which transformers architecture, is each family's
declaration (`ModelFamily.gguf`, gathered in `registry.GGUF_ARCHITECTURES`).

Two things llama.cpp's converter changed are undone here:
- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on;
- where the family says so (`GGUFArchitecture.permuted_qk`: `llama`), the rows of Q and K are
  permuted per head (its RoPE rotates adjacent pairs; Hugging Face's rotates the two halves):
  row `2i + j` of a head in the file is row `j * d/2 + i` of the Hugging Face tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
from typing import Any

import numpy as np

from dcpjax.loader.gguf_metadata import open_reader
from dcpjax.loader.tensor_source import TensorSource, slice_ranges
from dcpjax.models.registry import FAMILIES, GGUF_ARCHITECTURES
from dcpjax.quantization import gguf_blocks
from dcpjax.quantization.formats import BlockFormat

GGUF_INSTALL = "pip install gguf"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf(path: str | pathlib.Path) -> bool:
    """A GGUF file: a `.gguf` name, or the format's magic bytes."""
    path = pathlib.Path(path)
    if not path.is_file():
        return False
    if path.suffix == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _gguf_module():
    try:
        import gguf
    except ImportError as error:
        raise ImportError(f"reading a GGUF file needs the gguf package: {GGUF_INSTALL}") from error
    return gguf


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its memory-mapped `gguf.GGUFReader` and its key-value metadata (arrays as lists)."""

    path: str
    reader: Any
    meta: dict[str, Any]

    def required(self, key: str) -> Any:
        """A metadata field the model cannot do without; ValueError naming it if absent."""
        if key not in self.meta:
            raise ValueError(f"{self.path}: GGUF metadata has no {key!r}; the file is incomplete or not a model")
        return self.meta[key]


def open_gguf(path: str | pathlib.Path) -> GGUFFile:
    """The parsed file (cached while the file is unchanged, so config, tokenizer and weights share one parse)."""
    resolved = pathlib.Path(path).resolve()
    stat = resolved.stat()
    return _parse(str(resolved), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _parse(path: str, mtime_ns: int, size: int) -> GGUFFile:
    gguf = _gguf_module()
    try:
        reader, meta = open_reader(gguf, path)
    except Exception as error:  # the reader raises what its parsing meets: a truncated or foreign file
        raise ValueError(f"{path} is not a readable GGUF file: {type(error).__name__}: {error}") from error
    return GGUFFile(path, reader, meta)


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name in a file of architecture `arch` (None:
    not one dcpjax uses)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    names = _LAYER_NAMES | dict(GGUF_ARCHITECTURES[arch].layer_names if arch in GGUF_ARCHITECTURES else {})
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    return None


def _architecture(file: GGUFFile) -> str:
    """The file's `general.architecture`, one a family reads (ValueError naming those otherwise)."""
    arch = file.meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        families = [family.name for family in FAMILIES if family.gguf]
        raise ValueError(f"{file.path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)} (the {', '.join(families)} "
                         f"famil{'y' if len(families) == 1 else 'ies'})")
    if file.meta.get(f"{arch}.expert_count"):
        raise ValueError(f"{file.path}: a mixture-of-experts GGUF ({arch} with {file.meta[f'{arch}.expert_count']} "
                         "experts) is not supported; load the model's Hugging Face folder instead")
    return arch


def _count(file: GGUFFile, key: str, default: int | None = None) -> int:
    """An integer field (one value for every layer: llama.cpp may store a per-layer array)."""
    value = file.meta.get(key, default) if default is not None else file.required(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{file.path}: {key} differs across layers ({sorted(set(value))}), which dcpjax does "
                             "not support")
        value = value[0]
    return int(value)


def hf_config(path: str | pathlib.Path) -> dict[str, Any]:
    """The file's model as a Hugging Face `config.json` dict (for `ModelConfig.from_hf`)."""
    file = open_gguf(path)
    path, meta, arch = file.path, file.meta, _architecture(file)
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    tensors = {t.name: t for t in file.reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor; the file is incomplete or not a model")
    hidden, heads = _count(file, f"{arch}.embedding_length"), _count(file, f"{arch}.attention.head_count")
    head_dim = int(get("attention.key_length", hidden // heads))
    rotary = get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 scaling) are not read "
                         "from GGUF yet; load the model's Hugging Face folder instead")
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch].architecture],
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are innermost first: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": _count(file, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _count(file, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _count(file, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": _float32(get("rope.freq_base", GGUF_ARCHITECTURES[arch].rope_theta)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    extra = GGUF_ARCHITECTURES[arch].extra_fields
    if extra is not None:
        config |= extra(meta, config["num_hidden_layers"])
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"{path}: RoPE scaling {scaling!r} in GGUF is not supported (only linear)")
        factor = _float32(file.required(f"{arch}.rope.scaling.factor"))
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return config


def _float32(value) -> float:
    """A float32 field as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


class GGUFSource(TensorSource):
    """The tensors of a GGUF file under Hugging Face names and shapes ([out, in] for a Linear),
    dequantized to float32 on read, or, for the types `gguf_blocks.HELD_TYPES` holds, read part by
    part (`read_part`: int8 codes, per-block scale and offset) to be held quantized. A tensor dcpjax
    has no name for keeps its llama.cpp name, so the checkpoint check reports it as unexpected
    instead of dropping it."""

    def __init__(self, path: str | pathlib.Path):
        file = open_gguf(path)
        self.path, arch = file.path, _architecture(file)
        self.quants = _gguf_module().quants
        self.tensors = {hf_name(t.name, arch) or t.name: t for t in file.reader.tensors}
        self.norm_offset = GGUF_ARCHITECTURES[arch].norm_offset  # the converter's + 1 on Gemma's norms
        heads = _count(file, f"{arch}.attention.head_count")
        kv_heads = _count(file, f"{arch}.attention.head_count_kv", heads)
        self.row_order: dict[str, np.ndarray] = {}  # HF row -> file row, for the permuted Q/K tensors
        if GGUF_ARCHITECTURES[arch].permuted_qk:
            for name, tensor in self.tensors.items():
                for proj, n in (("q_proj", heads), ("k_proj", kv_heads)):
                    if f".self_attn.{proj}." in name:
                        self.row_order[name] = _unpermute_rows(int(tensor.shape[-1]), n)
        self._last: tuple[str, np.ndarray] | None = None  # the last whole tensor: devices ask for it in turn
        self._last_parts: tuple[str, tuple] | None = None  # the same for the parts of a held one

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        tensor, shape = self.tensors[name], self.shape(name)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        rows = np.arange(*index[0].indices(shape[0]))
        if name in self.row_order:
            rows = self.row_order[name][rows]
        if len(rows) == shape[0] and name not in self.row_order:
            values = self._whole(name)
        else:
            values = self._dequantize(tensor, tensor.data[rows])
        return values[(slice(None), *index[1:])]

    def format(self, name: str) -> BlockFormat | None:
        tensor = self.tensors.get(name)
        if tensor is None or len(tensor.shape) != 2 or tensor.tensor_type not in gguf_blocks.HELD_TYPES:
            return None
        return gguf_blocks.held_format(tensor.tensor_type)

    def read_part(self, name: str, index: tuple[slice, ...], part: str) -> np.ndarray:
        fmt = self.format(name)
        if fmt is None or (part == "offset" and not fmt.has_offset):
            return super().read_part(name, index, part)
        values, scale, offset = self._parts(name)
        rows, cols = slice_ranges(index, self.shape(name))
        if part == "values":
            return values[rows.start:rows.stop, cols.start:cols.stop]
        per_block = scale if part == "scale" else offset
        groups = np.arange(cols.start, cols.stop) // fmt.block[1]
        return per_block[rows.start:rows.stop][:, groups].astype(np.float32)

    def _parts(self, name: str) -> tuple:
        """(values, scale, offset) of a whole held tensor, rows in Hugging Face order."""
        if self._last_parts is None or self._last_parts[0] != name:
            tensor = self.tensors[name]
            parts = gguf_blocks.unpack(np.asarray(tensor.data), tensor.tensor_type, self.shape(name)[1])
            if name in self.row_order:
                parts = tuple(None if p is None else p[self.row_order[name]] for p in parts)
            self._last_parts = (name, parts)
        return self._last_parts[1]

    def _whole(self, name: str) -> np.ndarray:
        if self._last is None or self._last[0] != name:
            tensor = self.tensors[name]
            self._last = (name, self._dequantize(tensor, tensor.data))
        return self._last[1]

    def _dequantize(self, tensor, data: np.ndarray) -> np.ndarray:
        try:
            values = self.quants.dequantize(np.asarray(data), tensor.tensor_type)
        except NotImplementedError as error:
            raise ValueError(f"{self.path}: tensor {tensor.name} is quantized as {tensor.tensor_type.name}, which "
                             f"this gguf package cannot dequantize ({error}); upgrade it: {GGUF_INSTALL} -U") from error
        values = values.astype(np.float32, copy=False)
        if self.norm_offset and tensor.name.endswith("norm.weight"):  # stored as offset + w: Hugging Face's is w
            values = values - np.float32(self.norm_offset)
        return values


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """For each Hugging Face row of a Q or K projection, the row of llama.cpp's permuted tensor."""
    head_dim = rows // heads
    hf = np.arange(rows)
    head, within = hf // head_dim, hf % head_dim
    half, i = within // (head_dim // 2), within % (head_dim // 2)
    return head * head_dim + 2 * i + half


def tokenizer(path: str | pathlib.Path):
    """The tokenizer (an `HFTokenizer`) and chat template the file's metadata carries; None if it
    carries none (prompts must then be token ids, as for a folder without tokenizer.json)."""
    from dcpjax.loader.gguf_tokenizer import gguf_tokenizer

    file = open_gguf(path)
    return gguf_tokenizer(file.meta, file.path) if "tokenizer.ggml.model" in file.meta else None
