"""Interleaved ownership of KV tokens over DCP ranks (vLLM's layout).

Token position p is owned by DCP rank `(p // I) % DCP` and stored there at local
index `(p // (I * DCP)) * I + p % I`, I being `cp_kv_cache_interleave_size`.
Runs of I consecutive tokens go to one rank, ranks take turns.

Paged form: a sequence's block table is shared by all DCP ranks. Logical block
j of the table covers the *virtual* block of `block_size * DCP` positions
`[j * block_size * DCP, (j + 1) * block_size * DCP)`; each rank stores its
`block_size` tokens of that range in its own copy of physical block
`block_table[j]`. `block_size % I == 0` keeps every run of I inside one block.

Every function takes jnp or numpy arrays (or ints) and broadcasts.
"""

from __future__ import annotations

import jax.numpy as jnp

PAD_SLOT = -1  # slot of a token this rank does not own: writes to it are dropped


def owner_rank(pos, dcp: int, interleave: int):
    """DCP rank that owns token position `pos`."""
    return (pos // interleave) % dcp


def local_index(pos, dcp: int, interleave: int):
    """Index of position `pos` in its owner rank's dense local KV."""
    return (pos // (interleave * dcp)) * interleave + pos % interleave


def global_position(local_idx, rank, dcp: int, interleave: int):
    """Inverse of `local_index`: the position stored at `local_idx` on `rank`."""
    return (local_idx // interleave) * (interleave * dcp) + rank * interleave + local_idx % interleave


def local_length(length, rank, dcp: int, interleave: int):
    """How many of the positions `0 .. length-1` rank `rank` owns.

    Summed over ranks this is `length`; a rank owning none gives 0 (empty shard).
    """
    round_size = interleave * dcp
    full_rounds = length // round_size
    rest = length % round_size
    return full_rounds * interleave + jnp.clip(rest - rank * interleave, 0, interleave)


def local_capacity(capacity: int, dcp: int, interleave: int) -> int:
    """Local slots per rank so that every position < `capacity` fits on its owner."""
    round_size = interleave * dcp
    return -(-capacity // round_size) * interleave


def check_block_size(block_size: int, interleave: int) -> None:
    """Raise ValueError unless runs of `interleave` tokens fit whole in a block."""
    if block_size < 1 or block_size % interleave != 0:
        raise ValueError(
            f"Rule 'block_size % cp_kv_cache_interleave_size == 0' failed: {block_size} % {interleave} = "
            f"{block_size % interleave if block_size >= 1 else 'n/a'}. Choose a block_size that is a multiple "
            f"of {interleave}, e.g. {interleave * max(1, -(-16 // interleave))}."
        )


def virtual_block_size(block_size: int, dcp: int) -> int:
    """Positions covered by one block-table entry: block_size on each of dcp ranks."""
    return block_size * dcp


def paged_slot_mapping(pos, block_table, rank, block_size: int, dcp: int, interleave: int, page_offsets=None):
    """Slot (`physical_block * block_size + offset`) of each position on `rank`.

    Args:
      pos: [...] token positions (int).
      block_table: [..., max_blocks] physical block ids, broadcast against `pos`
        on the leading dims (one table per sequence, shared by all DCP ranks).
      rank: this DCP rank (int or traced scalar).
      page_offsets: optional [...] like `pos`: where each token's sequence's blocks begin in the
        table (a packed row holds several sequences' tables back to back); None: 0.

    Returns:
      [...] int32 slots; `PAD_SLOT` where `rank` does not own the position.
    """
    check_block_size(block_size, interleave)
    pos = jnp.asarray(pos)
    block_table = jnp.asarray(block_table)
    # [B, max_blocks] against pos [B, T]: give the table pos's rank plus one.
    block_table = block_table.reshape(
        block_table.shape[:-1] + (1,) * (pos.ndim + 1 - block_table.ndim) + block_table.shape[-1:]
    )
    logical_block = pos // virtual_block_size(block_size, dcp)
    if page_offsets is not None:
        logical_block = logical_block + jnp.asarray(page_offsets)
    index = jnp.broadcast_to(logical_block[..., None], jnp.broadcast_shapes(pos.shape, block_table.shape[:-1]) + (1,))
    physical_block = jnp.take_along_axis(block_table, index, axis=-1)[..., 0]
    offset = local_index(pos, dcp, interleave) % block_size
    slot = physical_block * block_size + offset
    return jnp.where(owner_rank(pos, dcp, interleave) == rank, slot, PAD_SLOT).astype(jnp.int32)


def blocks_needed(num_tokens: int, block_size: int, dcp: int) -> int:
    """Block-table entries (each a physical block on every rank) for `num_tokens`."""
    return -(-num_tokens // virtual_block_size(block_size, dcp))
