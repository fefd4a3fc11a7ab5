"""Decode attention kernels that return (out, lse): Pallas and a jnp reference."""

from dcpjax.kernels.dispatch import ATTENTION_BACKENDS, chunk_attention, decode_attention, resolve_backend
from dcpjax.kernels.pallas_decode import chunk_attention_pallas, decode_attention_pallas
from dcpjax.kernels.reference import chunk_attention_reference, decode_attention_reference, gather_pages

__all__ = [
    "ATTENTION_BACKENDS",
    "chunk_attention",
    "chunk_attention_pallas",
    "chunk_attention_reference",
    "decode_attention",
    "decode_attention_pallas",
    "decode_attention_reference",
    "gather_pages",
    "resolve_backend",
]
