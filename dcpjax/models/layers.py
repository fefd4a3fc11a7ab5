"""Sharded building blocks (Flax NNX): parameters carry their logical axes.

Parameters are declared with their *global* shapes and logical axis names; the
runner shards them by `ShardingRules` (`RULES`) and calls the modules inside
`shard_map`, where every array is this device's shard. Row-parallel products
(O projection, MLP down, embedding lookup) end in a psum over all TP devices.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from dcpjax.quantization.weight import linear, linear_transposed, take_rows
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import MODEL_AXES, RULES, gather_model, reduce_model

# Axes where zeros past the true size change nothing, so a size the mesh cannot split evenly
# is rounded up instead of refused:
#   ffw / moe_ffw: padded gate and up columns give silu(0) * 0 = 0, padded down rows add 0;
#   vocab: padded embedding rows are never looked up, padded logits are dropped;
#   ep_experts: padded experts are never routed (the router scores only the real ones).
PADDABLE_AXES = ("ffw", "moe_ffw", "vocab", "ep_experts")


# Weights held quantized want each device's share of a padded axis in whole quantization groups
# (`padding_multiple`): padding that is needed anyway then rounds each share up to a multiple of it.
_PAD_MULTIPLE = contextvars.ContextVar("dcpjax_pad_multiple", default=1)


@contextlib.contextmanager
def padding_multiple(multiple: int) -> Iterator[None]:
    """Parameters declared inside pad a paddable axis the mesh cannot split evenly so that each
    device's share is a multiple of `multiple` (a quantization block: SmolLM2's FFW of 1536 at TP 9
    becomes 9 x 192, not 9 x 171, so its 32-wide GGUF blocks stay whole on every device)."""
    token = _PAD_MULTIPLE.set(multiple)
    try:
        yield
    finally:
        _PAD_MULTIPLE.reset(token)


def padded_size(size: int, logical_axis: str | None, pc: ParallelConfig) -> int:
    """`size` rounded up to a multiple of the shards of `logical_axis` (if it is paddable and the
    shards do not divide it; see `padding_multiple`)."""
    if logical_axis not in PADDABLE_AXES:
        return size
    ways = RULES.ways(logical_axis, pc)
    if size % ways == 0:
        return size
    # Quantization blocks lie inside one expert's matrices, never across experts: whole experts
    # need no block multiple (with one, 6 experts at TP 4 under fp8 would pad to 512).
    multiple = 1 if logical_axis == "ep_experts" else _PAD_MULTIPLE.get()
    step = ways * multiple
    return -(-size // step) * step


def param(shape: tuple[int, ...], logical_axes: tuple[str | None, ...], dtype, init: str = "normal",
          pc: ParallelConfig | None = None) -> nnx.Param:
    """A parameter placeholder; values come from a checkpoint or `init` ("normal", "ones", "zeros").

    `shape` is the model's true shape; with `pc`, the paddable axes are rounded up for its mesh
    (zeros there: see `PADDABLE_AXES`). `unpadded_shape` keeps the true shape for loaders and
    checkpoints.
    """
    padded = shape if pc is None else tuple(padded_size(n, a, pc) for n, a in zip(shape, logical_axes))
    return nnx.Param(jnp.zeros(padded, dtype), logical_axes=logical_axes, init=init, unpadded_shape=tuple(shape))


def unsplittable_dims(state: nnx.State, pc: ParallelConfig) -> list[str]:
    """Every parameter dimension the mesh cannot split evenly, one sentence each (empty: all fit).
    Paddable axes never appear (they are padded); the others must divide."""
    problems = []
    for path, var in nnx.to_flat_state(state):
        for i, (n, axis) in enumerate(zip(var.get_value().shape, var.logical_axes)):
            ways = RULES.ways(axis, pc)
            if n % ways:
                name = ".".join(str(getattr(p, "key", p)) for p in path)
                fits = [w for w in range(1, min(n, 64) + 1) if n % w == 0]
                problems.append(f"parameter {name} dimension {i} ({axis!r}, size {n}) cannot be split over {ways} "
                                f"devices; split counts that divide it: {fits}")
    return problems


class RMSNorm(nnx.Module):
    """x / rms(x) * (weight + offset), computed in float32 (as the reference implementations do).

    offset 1: checkpoints that store the weight centred on 0 (Gemma, Qwen3-Next)."""

    def __init__(self, dim: int, eps: float, dtype, axis: str | None = "embed", offset: float = 0.0):
        self.weight = param((dim,), (axis,), dtype, init="zeros" if offset else "ones")
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:  # Gemma / Qwen3-Next: (offset + w) in float32, one cast (1 + w in bfloat16 drops small w)
            return (normed * (self.weight[...].astype(jnp.float32) + self.offset)).astype(x.dtype)
        return self.weight[...] * normed.astype(x.dtype)  # Llama's order: cast, then scale in the weight's dtype


class LayerNorm(nnx.Module):
    """(x - mean) / std * weight + bias over the last axis, in float32 (torch's nn.LayerNorm), replicated."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = param((dim,), (None,), dtype, init="ones")
        self.bias = param((dim,), (None,), dtype, init="zeros")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


# config.json's hidden_act -> the function; zero at zero, so padded FFW columns still add nothing
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GeGLU (Gemma)
}


class GatedMLP(nnx.Module):
    """SwiGLU (or GeGLU): down(act(gate(x)) * up(x)); ffw split over all TP devices."""

    def __init__(self, hidden: int, intermediate: int, dtype, pc: ParallelConfig, activation: str = "silu"):
        self.gate = param((hidden, intermediate), ("embed", "ffw"), dtype, pc=pc)
        self.up = param((hidden, intermediate), ("embed", "ffw"), dtype, pc=pc)
        self.down = param((intermediate, hidden), ("ffw", "embed"), dtype, pc=pc)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., hidden] (replicated) -> [..., hidden] (replicated)."""
        return reduce_model(self.partial(x))

    def partial(self, x: jax.Array) -> jax.Array:
        """This device's share of the output, before the reduction over all TP devices."""
        return linear(ACTIVATIONS[self.activation](linear(x, self.gate)) * linear(x, self.up), self.down)


class VocabEmbedding(nnx.Module):
    """Embedding table split by vocabulary rows over all TP devices."""

    def __init__(self, vocab: int, hidden: int, dtype, pc: ParallelConfig):
        self.weight = param((vocab, hidden), ("vocab", "embed"), dtype, pc=pc)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [...] int -> [..., hidden]: each device looks up the ids it holds, then psum."""
        rows = self.weight.shape[0]
        local = tokens - jax.lax.axis_index(MODEL_AXES) * rows
        inside = (local >= 0) & (local < rows)
        found = take_rows(self.weight, jnp.clip(local, 0, rows - 1))  # the weight may be held quantized
        return reduce_model(jnp.where(inside[..., None], found, 0))

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [..., hidden] -> this device's logits [..., padded vocab / TP] (float32)."""
        return linear_transposed(x, self.weight, out_dtype=jnp.float32)


class LMHead(nnx.Module):
    def __init__(self, hidden: int, vocab: int, dtype, pc: ParallelConfig):
        self.weight = param((hidden, vocab), ("embed", "vocab"), dtype, pc=pc)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., hidden] -> this device's logits [..., padded vocab / TP] (float32)."""
        return linear(x, self.weight, out_dtype=jnp.float32)


def out_projection(out: jax.Array, o_proj) -> jax.Array:
    """Attention output [B, T, heads, d] x o_proj [heads, d, hidden] -> [B, T, hidden] (this
    device's partial sum over its heads).

    As one 2-D matmul over (heads * d): contracting the two axes separately let XLA:CPU pick the
    attention output's (d, heads) layout and transpose the weight to it, a copy of o_proj at
    every step of every layer (a fifth of SmolLM2's decode step); flattened, it copies the
    small activation instead, if anything.
    """
    return linear(out, o_proj, contract=2)


def gather_vocab(local_logits: jax.Array, vocab_size: int) -> jax.Array:
    """[..., padded vocab / TP] shards -> full [..., vocab_size] logits; the padding dropped."""
    full = gather_model(local_logits, axis=local_logits.ndim - 1)
    return full[..., :vocab_size]


def expert_axes(pc: ParallelConfig, down: bool = False) -> tuple[str | None, ...]:
    """Logical axes of a stacked routed-expert weight, [experts, hidden, ffw] (gate, up) or
    [experts, ffw, hidden] (`down`): tensor-parallel experts split every expert's FFW over all TP
    devices; with `pc.enable_expert_parallel` each device holds whole experts, E / TP of them."""
    experts, ffw = ("ep_experts", None) if pc.enable_expert_parallel else ("experts", "moe_ffw")
    return (experts, ffw, "embed") if down else (experts, "embed", ffw)


def routed_experts(x, experts, weights, w_gate, w_up, w_down, expert_parallel: bool = False):
    """Each token through its chosen experts, weighted (grouped matmuls, no dense E x work).

    x [N, hidden] (replicated); experts, weights [N, k] (global expert ids); w_gate, w_up
    [E_local, hidden, I]; w_down [E_local, I, hidden]. Tensor-parallel experts: E_local = E and I
    is this device's share of each expert's FFW. `expert_parallel`: this device holds whole experts
    E_local * rank ... E_local * (rank + 1) - 1 and runs only the token copies routed to them.
    Returns [N, hidden], this device's partial sum: the caller's reduction over all TP devices
    completes it either way (nothing is dropped: every copy is some device's).
    """
    top_k, local = experts.shape[1], w_gate.shape[0]
    flat, weight = experts.reshape(-1), weights.reshape(-1)
    if expert_parallel and jax.lax.axis_size(MODEL_AXES) > 1:
        flat = flat - jax.lax.axis_index(MODEL_AXES) * local
        mine = (flat >= 0) & (flat < local)
        # another device's copies sort last, past every group (`local` is no group: bincount drops it)
        flat, weight = jnp.where(mine, flat, local), jnp.where(mine, weight, 0)
    order = jnp.argsort(flat)  # group token copies by expert
    rows = order // top_k
    sizes = jnp.bincount(flat, length=local).astype(jnp.int32)
    grouped = x[rows]
    hidden = jax.nn.silu(jax.lax.ragged_dot(grouped, w_gate, sizes)) * jax.lax.ragged_dot(grouped, w_up, sizes)
    out = jax.lax.ragged_dot(hidden, w_down, sizes)
    # rows past the groups (other devices' copies) weigh 0; `where`, not a product: their values are the kernel's
    sorted_weight = weight[order][:, None]
    out = jnp.where(sorted_weight != 0, out * sorted_weight.astype(x.dtype), 0)
    return jnp.zeros_like(x).at[rows].add(out)


class SparseMoE(nnx.Module):
    """Top-k softmax-routed experts (Qwen3-MoE); each expert's FFW split over all TP devices.
    With `shared_intermediate` (Qwen3-Next, Qwen2-MoE) a shared expert runs on every token too,
    scaled by a sigmoid gate of its own."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool, dtype,
                 pc: ParallelConfig, shared_intermediate: int = 0):
        self.router = param((hidden, num_experts), ("embed", None), dtype)
        self.gate = param((num_experts, hidden, intermediate), expert_axes(pc), dtype, pc=pc)
        self.up = param((num_experts, hidden, intermediate), expert_axes(pc), dtype, pc=pc)
        self.down = param((num_experts, intermediate, hidden), expert_axes(pc, down=True), dtype, pc=pc)
        self.top_k, self.norm_topk_prob, self.expert_parallel = top_k, norm_topk_prob, pc.enable_expert_parallel
        self.shared = GatedMLP(hidden, shared_intermediate, dtype, pc) if shared_intermediate else None
        self.shared_gate = param((hidden, 1), ("embed", None), dtype) if shared_intermediate else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., hidden] (replicated) -> [..., hidden] (replicated)."""
        flat = x.reshape(-1, x.shape[-1])
        probs = jax.nn.softmax((flat @ self.router[...]).astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        out = routed_experts(flat, experts, weights, self.gate[...], self.up[...], self.down[...],
                             self.expert_parallel)
        if self.shared is not None:  # both partial sums, then one reduction
            out = out + jax.nn.sigmoid(flat @ self.shared_gate[...]) * self.shared.partial(flat)
        return reduce_model(out).reshape(x.shape)
