"""A model's weights on the mesh, from one place: its structure checked against the mesh, the
source read through the chosen quantization, the parameters held quantized swapped in, then
every device's slice read (`load_model`); and the same count of bytes per device for a model
not loaded (`planned_weight_bytes`, the planner's).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from flax import nnx
from jax.sharding import Mesh

from dcpjax.loader.checkpoint import restore_state
from dcpjax.loader.holding import (
    Held,
    held_quantized,
    held_summary,
    hold_quantized,
    pad_multiple,
    weight_bytes_per_device,
)
from dcpjax.loader.quantized_source import fp8_formats, quantized_source
from dcpjax.loader.rules import ignored_checkpoint_tensor, model_rules
from dcpjax.loader.tensor_source import TensorSource
from dcpjax.loader.weights import load_state
from dcpjax.models.config import ModelConfig
from dcpjax.models.registry import build_model
from dcpjax.quantization.formats import DEFAULT_FP8_BLOCK, CheckpointQuantization, fp8_format
from dcpjax.sharding.config import ParallelConfig

logger = logging.getLogger(__name__)
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model on the mesh: its graph, its sharded state, the parameters held quantized and the
    bytes of weights each device holds (`holding.weight_bytes_per_device`)."""

    graphdef: nnx.GraphDef
    state: nnx.State
    held: dict[str, Held]
    weight_bytes_per_device: int

    def describe(self) -> str:
        """e.g. "84 weights held quantized (fp8 x84), scales included" or "every weight in the model dtype"."""
        if not self.held:
            return "every weight in the model dtype"
        kinds = ", ".join(f"{name} x{count}" for name, count in sorted(held_summary(self.held).items()))
        return f"{len(self.held)} weights held quantized ({kinds}), scales included"


def load_model(cfg: ModelConfig, pc: ParallelConfig, mesh: Mesh, dtype, weights: Callable[[], TensorSource], *,
               quantization: str | None = None, is_gguf: bool = False,
               checkpoint: CheckpointQuantization | None = None, orbax_checkpoint: str | None = None,
               progress: bool = True, label: str = "Model") -> LoadedModel:
    """Build the model for `pc` (ValueError before any weight is read if the mesh cannot hold it),
    then read its weights: from the orbax checkpoint if given, else from `weights()` through
    `quantization` (`quantized_source.quantized_source`: `checkpoint` is what the weights hold, an
    fp8 checkpoint read as fp8; `is_gguf`: a GGUF file's). Logs "`label` weights: X GiB per device"."""
    graphdef, state = build_model(cfg, pc, dtype)  # also checks the TP/DCP rules for this model
    held = {}
    if orbax_checkpoint is not None:
        if quantization not in (None, "auto", "none"):
            raise ValueError(f"quantization={quantization!r} with orbax_checkpoint: an orbax checkpoint holds the "
                             "weights in the model dtype; load the quantized checkpoint itself instead")
        state = restore_state(state, cfg, pc, mesh, orbax_checkpoint)
    else:
        platform = mesh.devices.flat[0].platform
        source = quantized_source(weights(), quantization, is_gguf, checkpoint, cfg.quantization, platform)
        rules, names = model_rules(cfg, pc), source.names()
        multiple = pad_multiple({source.format(name) for name in names})
        if multiple > 1:  # padded axes in whole quantization blocks
            graphdef, state = build_model(cfg, pc, dtype, pad_multiple=multiple)
        held = held_quantized(rules, lambda name, shape: source.format(name) if name in names else None, state, pc)
        graphdef, state = hold_quantized(graphdef, state, held)
        state = load_state(state, rules, source, mesh, progress=progress, held=held,
                           ignored=lambda name: ignored_checkpoint_tensor(cfg, name))
    loaded = LoadedModel(graphdef, state, held, weight_bytes_per_device(state, pc))
    logger.info("%s weights: %.3f GiB per device (%s bytes; %s)", label, loaded.weight_bytes_per_device / GIB,
                f"{loaded.weight_bytes_per_device:,}", loaded.describe())
    return loaded


def planned_weight_bytes(cfg: ModelConfig, pc: ParallelConfig, dtype, quantization: str | None = None) -> int:
    """Bytes of weights per device the engine would hold for `cfg` on `pc` in `dtype`, with
    `quantization="fp8"`: the linear projections fp8 in the model's `weight_block_size` (default
    128 x 128; per tensor if its quantization_config has none), as `load_model` holds them (the
    same rules, the same padding and the same count)."""
    if quantization not in (None, "none", "fp8"):
        raise ValueError(f"planned_weight_bytes plans quantization None, 'none' or 'fp8', got {quantization!r}")
    if quantization != "fp8":
        return weight_bytes_per_device(build_model(cfg, pc, dtype)[1], pc)
    block = cfg.quantization.weight_block_size if cfg.quantization else DEFAULT_FP8_BLOCK
    format_of = fp8_formats(block)
    graphdef, state = build_model(cfg, pc, dtype, pad_multiple=pad_multiple({fp8_format(block)} if block else ()))
    held = held_quantized(model_rules(cfg, pc), format_of, state, pc)
    return weight_bytes_per_device(hold_quantized(graphdef, state, held)[1], pc)
