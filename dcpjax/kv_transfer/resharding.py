"""From the producer's layout to the consumer's, on the consumer's host (numpy), in one gather per field.

What arrives is, per DCP rank r of the producer, its tokens in r's local order (`KVLayout.wire_specs`).
For each DCP rank d of the consumer, the positions d owns in d's local order are looked up in the
producer's ranks (`source_index`): what comes out is already in the consumer's local orders, so each
consumer device is then sent only what it stores (`KVMover.scatter`'s sharded `device_put`). KV heads
travel once each, in head order, and are repeated here into the consumer's stored head slots. The
dtype is left as it came: the consumer's devices convert (`quantize_fp8`, as the cache stores a token).
"""

from __future__ import annotations

import numpy as np

from dcpjax.kv_transfer.layout import STATE_FIELDS, KVLayout, bucket, pool_name, state_name


def source_index(sender: KVLayout, receiver: KVLayout, num_tokens: int) -> tuple[np.ndarray, list[int]]:
    """index [receiver DCP, tokens]: for each consumer rank, the place of each of its positions (in its
    local order, padded with 0 to a bucket) in the producer's ranks laid end to end; and the consumer
    ranks' lengths."""
    lengths = receiver.rank_lengths(num_tokens)
    starts = np.cumsum([0, *sender.rank_lengths(num_tokens)])[:-1]
    index = np.zeros((receiver.dcp, bucket(max(lengths))), np.int64)  # a compiled scatter's size
    for d, n in enumerate(lengths):
        p = receiver.positions(d, num_tokens)
        index[d, :n] = starts[sender.owner(p)] + sender.local(p)
    return index, lengths


def for_receiver(arrays: dict[str, np.ndarray], sender: KVLayout, receiver: KVLayout, num_tokens: int,
                 tokens_per_rank: int | None = None):
    """The pulled arrays as `KVMover.scatter` takes them: (updates: per pool field [receiver DCP,
    kv_layers, receiver kv_slots, tokens, ...], states: per linear layer {field: row}, lengths).

    tokens_per_rank: the producer's arrays are padded to this many tokens per rank (None: trimmed)."""
    index, lengths = source_index(sender, receiver, num_tokens)
    slots = np.arange(receiver.kv_heads * receiver.head_repeats) // receiver.head_repeats
    sent = sender.rank_lengths(num_tokens)
    updates = {}
    for field in sender.pool_fields:
        parts = [np.asarray(arrays[pool_name(field, r)]) for r in range(sender.dcp)]
        if tokens_per_rank is not None:
            parts = [part[:, :, :n] for part, n in zip(parts, sent)]
        whole = np.concatenate(parts, axis=2)  # [kv_layers, kv_heads, num_tokens, ...]: each head once
        # each rank's positions first (one copy), then the stored head slots (a head repeated last)
        taken = np.take(whole, index, axis=2)[:, slots]  # [layers, slots, DCP, tokens, ...]
        updates[field] = np.moveaxis(taken, 2, 0)  # [DCP, layers, slots, tokens, ...]
    states = {i: {f: np.asarray(arrays[state_name(i, f)]) for f in STATE_FIELDS} for i in sender.linear_layers}
    return updates, states, lengths
