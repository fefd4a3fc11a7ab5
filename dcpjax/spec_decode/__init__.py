"""Speculative decoding: cheap proposals of the next k tokens, verified by the target model in one
chunk step (see `config.SpeculativeConfig` for the options and `verify` for why it is exact)."""

from dcpjax.spec_decode.config import SpeculativeConfig
from dcpjax.spec_decode.stats import SpecDecodeStats

__all__ = ["SpecDecodeStats", "SpeculativeConfig"]
