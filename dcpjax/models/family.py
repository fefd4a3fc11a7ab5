"""A model family's declaration: everything dcpjax knows about one family, in the family's module.

Each family module (`llama.py`, `deepseek.py`, `qwen3_next.py`, `gemma3.py`) ends with one `FAMILY =
ModelFamily(...)`: the architectures (`config.json`'s "architectures") it builds, how it reads
its own config fields, its checkpoint's tensor names and layouts, its model class, the GGUF
architectures it reads and its built-in tiny models. `dcpjax.models.registry` lists the families;
nothing else names an architecture. Adding a family is one module and one registry line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from dcpjax.models.base import CausalLM
from dcpjax.models.config import ConfigFields, ModelConfig, TextPart
from dcpjax.models.weight_rules import Rule
from dcpjax.sharding.config import ParallelConfig

# (config, parallel config) -> dcpjax parameter path -> how it is read from the Hugging Face checkpoint
CheckpointRules = Callable[[ModelConfig, ParallelConfig], dict[str, Rule]]


def no_own_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """A family whose configs hold only the fields every family shares."""
    return {}


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """A llama.cpp `general.architecture` a family reads: the transformers architecture dcpjax
    builds for it, the RoPE base a file may leave out, and whether llama.cpp's converter permuted
    the rows of Q and K per head (its RoPE rotates adjacent pairs; transformers' the two halves).

    norm_offset: what the converter added to every norm weight (Gemma's are stored as 1 + w),
      taken off on read so the checkpoint rules see Hugging Face's values.
    layer_names: llama.cpp layer tensor names (after `blk.N.`) whose Hugging Face name differs
      from the Llama one for this architecture (Gemma's `ffn_norm` is its pre-feedforward norm).
    extra_fields: (the file's metadata, its layer count) -> more `config.json` fields, what the
      file leaves out and llama.cpp's loader hard-codes for the architecture.
    """

    architecture: str
    rope_theta: float
    permuted_qk: bool = False
    norm_offset: float = 0.0
    layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    extra_fields: Callable[[dict[str, Any], int], dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family: what the config reader, the loader and `build_model` ask of it."""

    name: str  # in messages: "Llama", "DeepSeek-V3"
    architectures: tuple[str, ...]
    model_class: type[CausalLM]  # model_class(cfg, pc, dtype)
    checkpoint_rules: CheckpointRules
    config_fields: ConfigFields = no_own_fields  # its own fields, and its checks (ValueError), over the shared ones
    gguf: Mapping[str, GGUFArchitecture] = dataclasses.field(default_factory=dict)
    tiny_models: Mapping[str, ModelConfig] = dataclasses.field(default_factory=dict)
    text_parts: Mapping[str, TextPart] = dataclasses.field(default_factory=dict)  # multimodal wrappers it reads
