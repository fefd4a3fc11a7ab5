"""A linear-attention layer's cache: a fixed-size state per sequence, indexed by the engine's slot
(Gated DeltaNet: `dcpjax.models.gated_delta`), beside the paged KV of the full-attention layers.

A sequence finds its state in its slot at each call and leaves the updated one there; one that
starts at position 0 starts from zeros, so a slot needs no clearing between owners (a new
sequence, or a preempted one recomputing from its start).
"""

from __future__ import annotations

import dataclasses
import functools

import jax


@functools.partial(jax.tree_util.register_dataclass, data_fields=["conv_q", "conv_k", "conv_v", "recurrent"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LinearState:
    """Per slot, heads first after it (each device holds its heads' part):

    conv_q, conv_k: [slots, key_heads, dk, K - 1]; conv_v: [slots, value_heads, dv, K - 1]: the
      causal convolution's last K - 1 inputs, oldest first;
    recurrent: [slots, value_heads, dk, dv] float32: the delta rule's state.
    """

    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    recurrent: jax.Array

    def bytes_per_device(self) -> int:
        """State bytes one device holds of these (sharded) arrays, for every slot."""
        return sum(a.addressable_shards[0].data.nbytes for a in (self.conv_q, self.conv_k, self.conv_v,
                                                                  self.recurrent))
