"""Model families under DCP (Flax NNX), their configs, layers and checkpoint rules.

The registry is imported first, so every family is registered with the config reader
(`ModelConfig.from_hf`, `TINY_MODELS`) before any module of this package is used.
"""

from dcpjax.models import registry

__all__ = ["registry"]
