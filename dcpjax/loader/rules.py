"""Which rule reads each dcpjax parameter, and which checkpoint tensors may go unread.

A config's rules are its family's (`ModelFamily.checkpoint_rules`, built from the shared
`dcpjax.models.component_rules` over `dcpjax.models.weight_rules`): the families know their
checkpoints' names and layouts, the loader only runs the rules (`dcpjax.loader.weights`).
"""

from __future__ import annotations

import re

from dcpjax.models.config import ModelConfig
from dcpjax.models.registry import family_of
from dcpjax.models.weight_rules import Rule
from dcpjax.sharding.config import ParallelConfig

# rotary caches; a multi-token-prediction head (`mtp.*`: Qwen3-Next's, which transformers skips too)
IGNORED_CHECKPOINT_TENSORS = re.compile(r".*rotary_emb\.inv_freq$|^mtp\.")


def model_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """dcpjax parameter path -> Rule, from the config's family."""
    return family_of(cfg.architecture).checkpoint_rules(cfg, pc)


def ignored_checkpoint_tensor(cfg: ModelConfig, name: str) -> bool:
    """Tensors a checkpoint may carry that dcpjax does not use: rotary caches and multi-token-prediction
    layers (`mtp.*`, and DeepSeek-V3's layers past num_hidden_layers)."""
    if IGNORED_CHECKPOINT_TENSORS.match(name):
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers
