"""`KVLayout`: one engine's KV cache as the connector sees it, the one place that knows where a
position lives.

A producer's layout travels in each handle it returns; a consumer checks it against its own
(`compatibility_problems`: the same model's cache, whatever the parallel layout) and maps positions
between the two (`owner`, `local`, `positions`). Plain Python and numpy: the router and the tests
build and read it without JAX.

Ownership (vLLM's DCP semantics, `sharding.layout`): position p is stored by DCP rank
`(p // I) % DCP`, at index `(p // (I * DCP)) * I + p % I` of that rank's local order; a KV head is
stored `head_repeats` times when the TP // DCP head groups outnumber the KV heads (MLA: one head).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from dcpjax.sharding import layout as positions_layout

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
VALUE_FIELDS = ("k", "v")  # a layer's value pools (MLA: "k" alone, the latent; DSA: "k" and "index_k")
SCALE_FIELDS = ("k_scale", "v_scale", "index_k_scale")  # an fp8 cache's float32 scale per token and head
STATE_FIELDS = ("conv_q", "conv_k", "conv_v", "recurrent")  # a linear layer's state row (`kernels.LinearState`)
# the model-identity fields: two caches that differ in any of them cannot exchange KV
MODEL_FIELDS = ("architecture", "layers", "kv_heads", "pool_dims", "value_fields", "state_shapes")


def bucket(n: int, smallest: int = 16) -> int:
    """The power of two >= n (at least `smallest`): the compiled sizes of a gather or scatter, and the
    tokens per rank a device transport's arrays are padded to."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def pool_name(field: str, rank: int) -> str:
    """A pool's array of one DCP rank as it travels: "k.0", "v_scale.3"."""
    return f"{field}.{rank}"


def state_name(layer: int, field: str) -> str:
    """A linear layer's state row as it travels: "state.2.recurrent"."""
    return f"state.{layer}.{field}"


def is_state(name: str) -> bool:
    return name.startswith("state.")


def rank_of(name: str) -> int:
    """The DCP rank of a pool's array (`pool_name`)."""
    return int(name.rsplit(".", 1)[1])


def kv_dtype(name: str) -> np.dtype:
    """A dtype by its numpy name, ml_dtypes' (bfloat16, float8_e4m3fn) included."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """An engine's KV cache: the model's layers and pools, and how TP / DCP / interleave / blocks
    place them.

    layers: per model layer, "kv" (paged attention KV) or "linear" (a fixed state per sequence).
    pool_dims: the last dim of each value pool of a KV layer: (dk, dv), or (latent,) for MLA.
    pool_names: the `KVPools` field of each of pool_dims; () is the first len(pool_dims) of ("k", "v")
      (MLA with DSA's indexer keys: ("k", "index_k")).
    state_shapes: a linear layer's state row per field, [heads, ...] float32 (hybrid models).
    head_repeats: stored copies of each KV head (the head groups over "tp" / kv_heads, at least 1).
    """

    architecture: str
    layers: tuple[str, ...]
    kv_heads: int
    pool_dims: tuple[int, ...]
    kv_dtype: str
    tp: int
    dcp: int
    interleave: int
    block_size: int
    head_repeats: int = 1
    state_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    pool_names: tuple[str, ...] = ()

    # -- where a position lives ----------------------------------------------------------------
    def owner(self, p):
        """The DCP rank that stores position p (int or array)."""
        return positions_layout.owner_rank(p, self.dcp, self.interleave)

    def local(self, p):
        """Position p's index in its owner's local order."""
        return positions_layout.local_index(p, self.dcp, self.interleave)

    def positions(self, rank: int, num_tokens: int) -> np.ndarray:
        """The positions < num_tokens that `rank` stores, in its local order [n_rank] int64."""
        local = np.arange(self.rank_lengths(num_tokens)[rank])
        return positions_layout.global_position(local, rank, self.dcp, self.interleave)

    def rank_lengths(self, num_tokens: int) -> list[int]:
        """How many of positions 0 .. num_tokens - 1 each DCP rank stores."""
        rounds, rest = divmod(num_tokens, self.interleave * self.dcp)
        return [rounds * self.interleave + min(max(rest - r * self.interleave, 0), self.interleave)
                for r in range(self.dcp)]

    # -- what the cache holds ------------------------------------------------------------------
    @property
    def num_kv_layers(self) -> int:
        return self.layers.count("kv")

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layers) if kind == "linear"]

    @property
    def quantized(self) -> bool:
        return kv_dtype(self.kv_dtype) == FP8

    @property
    def value_fields(self) -> tuple[str, ...]:
        """The value pools of a KV layer, in pool_dims' order."""
        return self.pool_names or VALUE_FIELDS[: len(self.pool_dims)]

    @property
    def pool_fields(self) -> tuple[str, ...]:
        """The pools of a KV layer: values, then (fp8) their scales."""
        values = self.value_fields
        return values + (tuple(f"{f}_scale" for f in values) if self.quantized else ())

    def padded_tokens(self, num_tokens: int) -> int:
        """Tokens per rank of a prompt's arrays as gathered, before they are trimmed: its blocks' bucket
        (what a device transport moves, since trimming on the device would compile once per length)."""
        blocks = positions_layout.blocks_needed(num_tokens, self.block_size, self.dcp)
        return bucket(blocks, 1) * self.block_size

    def wire_specs(self, num_tokens: int, padded: bool = False) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """What a prompt of num_tokens travels as, name -> (shape, dtype): per pool field and DCP rank
        r, "{field}.{r}" [kv_layers, kv_heads, n_r(, dim)] in r's local order (each KV head once;
        padded: [1, kv_layers, kv_heads, padded_tokens, ...], as gathered); per linear layer i and
        state field, "state.{i}.{field}" [heads, ...] float32."""
        specs, dtype, lengths = {}, kv_dtype(self.kv_dtype), self.rank_lengths(num_tokens)
        if padded:
            lengths = [self.padded_tokens(num_tokens)] * self.dcp
        for field in self.pool_fields:
            scale = field in SCALE_FIELDS
            dim = () if scale else (self.pool_dims[self.value_fields.index(field)],)
            for r, n in enumerate(lengths):
                shape = (self.num_kv_layers, self.kv_heads, n, *dim)
                element = np.dtype(np.float32) if scale else dtype
                specs[pool_name(field, r)] = ((1, *shape) if padded else shape, element)
        for i in self.linear_layers:
            for field, shape in self.state_shapes:
                specs[state_name(i, field)] = (tuple(shape), np.dtype(np.float32))
        return specs

    def kv_bytes(self, num_tokens: int, padded: bool = False) -> int:
        """Bytes of a prompt's KV (and linear state) as it travels: `wire_specs` summed."""
        specs = self.wire_specs(num_tokens, padded).values()
        return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs)

    # -- between two engines -------------------------------------------------------------------
    def compatibility_problems(self, other: KVLayout) -> list[str]:
        """Why `other`'s KV (a producer's) cannot serve this cache (empty: it can): another model.
        The parallel layout and the KV dtype may differ: they are re-sharded and converted."""
        return [f"{key}: the prefill server's {getattr(other, key)!r}, this server's {getattr(self, key)!r}"
                for key in MODEL_FIELDS if getattr(other, key) != getattr(self, key)]

    def as_dict(self) -> dict:
        """JSON-able, as the handle carries it (`from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        """The layout a handle carries; ValueError naming what is missing or malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"kv_layout must be an object, got {type(data).__name__}")  # noqa: TRY004 (a user's value)
        names = {f.name for f in dataclasses.fields(cls)}
        optional = ("head_repeats", "state_shapes", "pool_names")
        if missing := sorted(n for n in names if n not in data and n not in optional):
            raise ValueError(f"kv_layout lacks {missing}")
        try:
            return cls(
                architecture=str(data["architecture"]), layers=tuple(str(x) for x in data["layers"]),
                kv_heads=int(data["kv_heads"]), pool_dims=tuple(int(x) for x in data["pool_dims"]),
                kv_dtype=str(data["kv_dtype"]), tp=int(data["tp"]), dcp=int(data["dcp"]),
                interleave=int(data["interleave"]), block_size=int(data["block_size"]),
                head_repeats=int(data.get("head_repeats", 1)),
                state_shapes=tuple((str(f), tuple(int(x) for x in s)) for f, s in data.get("state_shapes", ())),
                pool_names=tuple(str(x) for x in data.get("pool_names", ())))
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"kv_layout is malformed: {err}") from None

    def __post_init__(self) -> None:
        for name in ("kv_heads", "tp", "dcp", "interleave", "block_size", "head_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_layout.{name} must be >= 1, got {getattr(self, name)}")
        if set(self.layers) - {"kv", "linear"}:
            raise ValueError(f"kv_layout.layers holds 'kv' or 'linear', got {sorted(set(self.layers))}")
        kv_dtype(self.kv_dtype)  # a TypeError for a dtype numpy does not know
        known = {"k", "v", "index_k"}
        if self.pool_names and (len(self.pool_names) != len(self.pool_dims) or set(self.pool_names) - known):
            raise ValueError(f"kv_layout.pool_names names one of k, v, index_k per pool_dims entry, got "
                             f"{list(self.pool_names)} for pool_dims {list(self.pool_dims)}")
