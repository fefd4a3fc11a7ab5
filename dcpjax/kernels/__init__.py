"""Attention kernels over a paged `KVCache` that return (out, lse): Pallas and a jnp reference.

Pure maths, no mesh: `dcpjax.sharding` imports this package, never the reverse.
"""

from dcpjax.kernels.common import ATTENTION_BACKENDS, AttentionOptions, check_attention_backend
from dcpjax.kernels.dispatch import attention, decode_attention, reads_only_visible_pages, resolve_backend
from dcpjax.kernels.kv_cache import KVCache, KVPools, gather_pages, quantize_fp8
from dcpjax.kernels.linear_state import LinearState
from dcpjax.kernels.pallas import attention_pallas

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionOptions",
    "KVCache",
    "KVPools",
    "LinearState",
    "attention",
    "attention_pallas",
    "check_attention_backend",
    "decode_attention",
    "gather_pages",
    "quantize_fp8",
    "reads_only_visible_pages",
    "resolve_backend",
]
